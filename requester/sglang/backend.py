"""The ``nsa`` attention backend with a pinned corpus: SGLang's NSA backend, plus the corpus.

Imports sglang: loaded only inside an SGLang process (through :mod:`.deepseek_v32`) or by the
GPU tests. Written against sglang 0.5.10.post1 and run in a live server (``pytest -m sglang``;
NOTES.md).

Per layer of a batch with corpus-bound requests (state in ``forward_batch.corpusd``, a
:class:`CorpusBatch` set by the entry model):

1. ``get_indexer_metadata`` returns :class:`CorpusIndexerMetadata`, whose ``topk_transform``
   receives the indexer's logits over the request's own tokens, scores the corpus's index keys
   with the same index query (captured by the entry model's indexer hook), and keeps one exact
   top-k over both (:func:`..topk.combined_topk`). It returns the own part, in SGLang's unfused
   format (positions within the request); the corpus part is kept for step 3.
2. ``forward_extend`` / ``forward_decode`` run SGLang's sparse kernel over the own part, keeping
   the LSE SGLang drops (our ``_forward_flashmla_sparse`` / ``_forward_flashmla_kv``).
3. The corpus part goes to corpusd (``CorpusLink.begin`` / ``finish``, :mod:`.host_path`: per
   holder group routed to the holder by corpusd's fan-out engine or fetched into the plugin's
   page cache and attended here, as ``choose.py`` decides); the two partials merge by LSE. On
   the host path the holder calls are sent before step 2 and waited for after it, so SGLang's
   own partial runs while they are in flight. On the device path (``resident``) the corpus
   partial reads the holders' pools on this GPU after it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from sglang.srt.layers.attention.nsa_backend import NativeSparseAttnBackend, NSAIndexerMetadata

from corpusd.kernels.flashmla import pad_heads, sparse_lse_base2
from corpusd.kernels.formats import FP8
from indexer.scores import index_scores
from indexer.select import select_topk
from requester.sglang import device, device_failover, device_scores, topk
from requester.sglang import lse as lse_mod
from requester.sglang.binding import Binding
from requester.sglang.dump import Dumper
from requester.sglang.host_path import Pending
from requester.sglang.link import CorpusLink
from requester.sglang.positions import to_corpusd_layout
from requester.sglang.resident import Resident


@dataclass
class CorpusBatch:
    """What one forward batch knows of its corpora (built by the entry model per forward)."""

    link: CorpusLink
    bindings: list[Binding | None]  # per request
    token_req: torch.Tensor  # int64 [N]: each token's request
    corpus_len: torch.Tensor  # int64 [N]: each token's T (0 unbound)
    ue8m0: bool
    mode: str  # "decode" or "extend": the timings' label
    index_q: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # The device path (resident.py): the tables, and per token its corpus's arena base page and
    # length, on the GPU. None on the host path.
    resident: Resident | None = None
    base: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    corpus_sel: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → [N, k]
    _rows: dict[tuple[int, str], list[tuple[Binding, torch.Tensor]]] = field(default_factory=dict)
    base2: bool = False  # the sparse kernel's LSE base on this device (fetch's local partial)
    dump: Dumper | None = None  # CORPUSD_SGLANG_DUMP: the forward's per-layer records (dump.py)

    def rows_by_corpus(self, n: int, device: torch.device) -> list[tuple[Binding, torch.Tensor]]:
        """Each corpus of the batch with its token rows among the first ``n`` (int64 on
        ``device``); worked out once per forward (the same for every layer)."""
        key = (n, str(device))
        if key not in self._rows:
            req = self.token_req[:n]
            groups: dict[str, list[int]] = {}
            for r, b in enumerate(self.bindings):
                if b is not None:
                    groups.setdefault(b.corpus_id, []).append(r)
            out = []
            for reqs in groups.values():
                rows = torch.isin(req, torch.tensor(reqs)).nonzero().flatten()
                b = self.bindings[reqs[0]]
                if b is not None and rows.numel():
                    out.append((b, rows.to(device)))
            self._rows[key] = out
        return self._rows[key]


@dataclass(frozen=True)
class CorpusIndexerMetadata(NSAIndexerMetadata):
    corpus: CorpusBatch | None = None
    layer_id: int = -1

    def topk_transform(
        self, logits: torch.Tensor, topk_: int, ks: Any = None, **kw: Any
    ) -> torch.Tensor:
        cb = self.corpus
        if cb is None or self.layer_id not in cb.index_q:
            return super().topk_transform(logits, topk_, ks=ks, **kw)
        chunked = ("cu_seqlens_q", "batch_idx_list", "topk_indices_offset_override")
        if any(kw.get(a) is not None for a in chunked):
            # _get_topk_ragged's chunked-logits path calls us once per chunk of rows.
            raise NotImplementedError(
                "corpusd plugin: chunked indexer logits (a very long prefill on a full GPU) are "
                "not supported yet; lower --chunked-prefill-size"
            )
        t0 = time.perf_counter()
        q_fp8, w = cb.index_q.pop(self.layer_id)
        n = logits.shape[0]
        lengths = kw.get("ke_offset")
        if lengths is None:
            lengths = self.get_seqlens_expanded()
        lengths = lengths[:n].to(torch.int64)
        if cb.resident is not None:
            return self._device_topk(cb, logits, lengths, ks, q_fp8[:n], w[:n], topk_)
        starts = ks[:n].to(torch.int64) if ks is not None else torch.zeros_like(lengths)
        width = int(lengths.max()) if n else 0
        cols = (starts[:, None] + torch.arange(width, device=logits.device)[None]).clamp(
            max=logits.shape[1] - 1
        )
        own_scores = logits.gather(1, cols)
        own_pos, own_s = topk.own_candidates(own_scores, lengths, topk_)
        t = cb.corpus_len[:n].to(logits.device)
        cpos = torch.full((n, topk_), -1, dtype=torch.int64, device=logits.device)
        cscore = torch.full((n, topk_), -math.inf, device=logits.device)
        corpus_rows: dict[int, torch.Tensor] = {}  # a dumped row's corpus scores
        for b, rows in cb.rows_by_corpus(n, logits.device):  # one scoring per corpus
            keys = cb.link.index_keys(b, self.layer_id, logits.device, cb.ue8m0)
            s = index_scores(q_fp8[rows].float(), w[rows].float().reshape(len(rows), -1), keys, 1.0)
            p = select_topk(s, topk_)
            cpos[rows], cscore[rows] = p, s.gather(1, p.clamp(min=0)).masked_fill(p < 0, -math.inf)
            if cb.dump is not None:
                corpus_rows |= {int(r): s[i] for i, r in enumerate(rows.tolist())}
        logical = topk.combined_topk(own_pos, own_s, cpos, cscore, t, topk_)
        if cb.dump is not None:
            for r in cb.dump.rows:
                if r < n:
                    c = corpus_rows.get(r, own_scores.new_zeros(0))
                    row = torch.cat([c.float(), own_scores[r, : int(lengths[r])].float()])
                    cb.dump.selection(self.layer_id, r, logical[r], row)
        corpus_part, own_part = topk.split_selection(logical, t)
        cb.corpus_sel[self.layer_id] = corpus_part
        own = own_part.to(torch.int32)
        cb.link.timings.add(f"corpus top-k ({cb.mode})", time.perf_counter() - t0)
        return own

    def _device_topk(
        self,
        cb: CorpusBatch,
        logits: torch.Tensor,
        lengths: torch.Tensor,
        ks: Any,
        q_fp8: torch.Tensor,
        w: torch.Tensor,
        topk_: int,
    ) -> torch.Tensor:
        """The device path's selection (graph-safe in decode): the corpus scored by SGLang's
        fp8 kernel over the arena, one exact top-k with the own logits."""
        assert cb.resident is not None and cb.base is not None and cb.tokens is not None
        n = logits.shape[0]
        if ks is None:  # paged (decode): column j is own position j
            own = logits
        else:  # ragged (prefill, eager): row i's keys start at column ks[i]
            width = int(lengths.max()) if n else 0
            cols = ks[:n].to(torch.int64)[:, None] + torch.arange(width, device=logits.device)
            own = logits.gather(1, cols.clamp(max=logits.shape[1] - 1))
        base, tokens = cb.base[:n], cb.tokens[:n]
        scores = device_scores.corpus_scores(cb.resident, self.layer_id, q_fp8, w, base, tokens)
        corpus, own_sel = device.fused_topk(scores, tokens, own, lengths, topk_)
        cb.corpus_sel[self.layer_id] = corpus
        if cb.dump is not None and not torch.cuda.is_current_stream_capturing():
            for r in cb.dump.rows:
                if r < n:
                    t, o = int(tokens[r]), int(lengths[r])
                    mine = torch.where(own_sel[r] >= 0, own_sel[r].long() + t, -1)
                    logical = torch.cat([corpus[r], mine])
                    row = torch.cat([scores[r, :t].float(), own[r, :o].float()])
                    cb.dump.selection(self.layer_id, r, logical, row)
        return own_sel


class CorpusNSABackend(NativeSparseAttnBackend):
    """SGLang's NSA backend; batches without a bound request take SGLang's path unchanged."""

    _lse: torch.Tensor | None = None  # natural [n, h] of the last local partial
    # the layer and batch whose own tokens and corpus rows the next flashmla_sparse call attends
    # in one call (CORPUSD_SGLANG_ONE_CALL); None once it has
    _one: tuple[Any, CorpusBatch] | None = None

    @staticmethod
    def _corpus(forward_batch: Any) -> CorpusBatch | None:
        cb = getattr(forward_batch, "corpusd", None)
        if cb is None:
            return None
        # The device path runs for every decode batch (its graphs serve any binding).
        return cb if cb.resident is not None or any(cb.bindings) else None

    # Before every forward, eager or a graph's replay, on the thread and stream that launch it:
    # holders found dead since the last step are failed over there (device_failover.py).
    def init_forward_metadata(self, *args: Any, **kw: Any) -> Any:
        device_failover.at_step_boundary()
        return super().init_forward_metadata(*args, **kw)

    def init_forward_metadata_replay_cuda_graph(self, *args: Any, **kw: Any) -> Any:
        device_failover.at_step_boundary()
        return super().init_forward_metadata_replay_cuda_graph(*args, **kw)

    def init_forward_metadata_replay_cuda_graph_from_precomputed(
        self, *args: Any, **kw: Any
    ) -> Any:
        device_failover.at_step_boundary()
        return super().init_forward_metadata_replay_cuda_graph_from_precomputed(*args, **kw)

    def set_nsa_prefill_impl(self, forward_batch: Any = None) -> None:
        super().set_nsa_prefill_impl(forward_batch)
        if forward_batch is not None and self._corpus(forward_batch) is not None:
            self.use_mha = False  # the dense MHA path has neither sparse top-k nor an LSE

    def get_indexer_metadata(self, layer_id: int, forward_batch: Any) -> Any:
        md = super().get_indexer_metadata(layer_id, forward_batch)
        cb = self._corpus(forward_batch)
        if md is None or cb is None:
            return md
        base = {f.name: getattr(md, f.name) for f in fields(NSAIndexerMetadata)}
        return CorpusIndexerMetadata(**base, corpus=cb, layer_id=layer_id)

    def _forward_flashmla_sparse(
        self,
        q_all: torch.Tensor,
        kv_cache: torch.Tensor,
        v_head_dim: int,
        page_table_1: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        from sgl_kernel.flash_mla import flash_mla_sparse_fwd

        if self._one is not None:  # the own tokens and the corpus rows in one call
            return self._one_call(q_all, kv_cache, v_head_dim, page_table_1, sm_scale)
        n, h, _ = q_all.shape
        o, _, raw = flash_mla_sparse_fwd(
            q=pad_heads(q_all, self.device_sm_major),
            kv=kv_cache,
            indices=page_table_1.unsqueeze(1),
            sm_scale=sm_scale,
            d_v=v_head_dim,
        )
        o, raw = o[:, :h], raw[:, :h]
        empty = (page_table_1 < 0).all(dim=1)[:, None].expand(n, h)
        self._lse = lse_mod.to_natural(raw, sparse_lse_base2(str(q_all.device))).masked_fill(
            empty, -math.inf
        )
        return o.masked_fill(empty[..., None], 0.0)

    def _one_call(
        self,
        q_all: torch.Tensor,
        kv_cache: torch.Tensor,
        v_head_dim: int,
        page_table_1: torch.Tensor,
        sm_scale: float,
    ) -> torch.Tensor:
        """SGLang's sparse call widened to the corpus (``device.one_call_partial``): its top-k
        list's own slots read its cache, its corpus slots the holders' rows, in one FlashMLA
        call; the result is the layer's attention, with nothing left to merge."""
        assert self._one is not None
        layer, cb = self._one
        self._one = None
        sel = cb.corpus_sel.pop(layer.layer_id, None)
        assert sel is not None and cb.resident is not None and cb.base is not None, (
            f"layer {layer.layer_id}: no corpus selection for the one call"
        )
        n = sel.shape[0]
        o, lse = device.one_call_partial(
            cb.resident, layer.layer_id, q_all, kv_cache, page_table_1, sel, cb.base[:n],
            sm_scale, v_head_dim, sparse_lse_base2(str(q_all.device)),
        )  # fmt: skip
        self._lse = lse
        return o.to(q_all.dtype)

    def _forward_flashmla_kv(
        self,
        q_all: torch.Tensor,
        kv_cache: torch.Tensor,
        v_head_dim: int,
        sm_scale: float,
        layer: Any,
        metadata: Any,
        page_table_1: Any,
    ) -> torch.Tensor:
        from sgl_kernel.flash_mla import flash_mla_with_kvcache
        from sglang.srt.layers.attention.nsa.quant_k_cache import quantize_k_cache

        q4 = q_all.view(-1, 1, layer.tp_q_head_num, layer.head_dim)
        kv = kv_cache.view(-1, self.real_page_size, 1, self.kv_cache_dim)
        if not self.nsa_kv_cache_store_fp8:
            kv = quantize_k_cache(kv)
        o, raw = flash_mla_with_kvcache(
            q=q4,
            k_cache=kv,
            cache_seqlens=metadata.nsa_cache_seqlens_int32,
            head_dim_v=v_head_dim,
            tile_scheduler_metadata=metadata.flashmla_metadata.flashmla_metadata,
            num_splits=metadata.flashmla_metadata.num_splits,
            softmax_scale=sm_scale,
            indices=page_table_1.unsqueeze(1),
            block_table=torch.empty((q4.shape[0], 0), dtype=torch.int32, device=q4.device),
            is_fp8_kvcache=True,
        )
        _, l_rows = lse_mod.decode_rows(o, raw)  # [b, 1, h, d] / [b, h, 1] → rows
        empty = (page_table_1 < 0).all(dim=1)[:, None].expand_as(l_rows)
        self._lse = lse_mod.to_natural(l_rows, base2=False).masked_fill(empty, -math.inf)
        return o.masked_fill(empty.reshape(o.shape[0], 1, -1, 1), 0.0)

    def _begin_corpus(
        self, q: torch.Tensor, q_rope: torch.Tensor | None, layer: Any, cb: CorpusBatch
    ) -> tuple[int, list[tuple[torch.Tensor, Pending]]]:
        """The host path's corpus calls for this layer, sent before SGLang's own partial is
        computed (issue 17: start the corpus call, compute the own partial, then wait): one
        link call per corpus, with every row of the batch bound to it (a call per holder).
        Returns the selection's row count and each call with its rows."""
        sel = cb.corpus_sel.pop(layer.layer_id, None)
        assert sel is not None, (
            f"layer {layer.layer_id}: no corpus selection; the corpusd plugin supports the NSA "
            f"backends formats.py lists with SGLANG_NSA_FUSE_TOPK=0"
        )
        q_all = _q_all(q, q_rope, layer)
        heads = _head_slice(layer)
        calls = []
        try:
            for b, rows in cb.rows_by_corpus(sel.shape[0], sel.device):
                qf = to_corpusd_layout(q_all[rows]).bfloat16()  # bf16 on the wire, as SGLang's q
                full = qf.new_zeros(len(rows), layer.tp_q_head_num * _tp_size(), qf.shape[-1])
                full[:, heads] = qf  # corpusd takes every head; this rank owns a slice
                p = cb.link.begin(b, layer.layer_id, full, sel[rows], layer.scaling, cb.base2)
                calls.append((rows, p))
        except BaseException:
            for _, p in calls:
                cb.link.abandon(p)
            raise
        return sel.shape[0], calls

    def _with_corpus(
        self,
        o: torch.Tensor,
        layer: Any,
        cb: CorpusBatch,
        begun: tuple[int, list[tuple[torch.Tensor, Pending]]],
    ) -> torch.Tensor:
        """The host path: the corpus calls :meth:`_begin_corpus` sent, waited for and merged
        with SGLang's own partial by LSE."""
        t0 = time.perf_counter()
        assert self._lse is not None, f"layer {layer.layer_id}: no local LSE"
        h = layer.tp_q_head_num
        n, calls = begun
        o_loc, lse_loc = o.reshape(-1, h, layer.v_head_dim)[:n], self._lse[:n]
        o_cor = torch.zeros_like(o_loc, dtype=torch.float32)
        l_cor = torch.full_like(lse_loc, -math.inf)
        heads = _head_slice(layer)
        for i, (rows, p) in enumerate(calls):
            try:
                o_r, l_r = cb.link.finish(p)
            except BaseException:
                for _, rest in calls[i + 1 :]:
                    cb.link.abandon(rest)
                raise
            o_cor[rows] = o_r[:, heads].to(o_cor.device)
            l_cor[rows] = l_r[:, heads].to(l_cor.device)
        cb.link.timings.add(f"holders wait ({cb.mode})", time.perf_counter() - t0)
        merged, _ = lse_mod.merge_local_corpus(o_loc, lse_loc, o_cor, l_cor)
        out = o.clone().reshape(-1, h, layer.v_head_dim)
        out[:n] = merged
        cb.link.timings.add(f"corpus attention ({cb.mode})", time.perf_counter() - t0)
        return out.view_as(o)

    def _with_corpus_device(
        self,
        o: torch.Tensor,
        q: torch.Tensor,
        q_rope: torch.Tensor | None,
        layer: Any,
        cb: CorpusBatch,
    ) -> torch.Tensor:
        """The corpus partial over the holders' mapped pools, merged with the local one: tensor
        ops only (captured in SGLang's decode graphs)."""
        sel = cb.corpus_sel.pop(layer.layer_id, None)
        assert sel is not None and self._lse is not None and cb.resident is not None, (
            f"layer {layer.layer_id}: no corpus selection or local LSE; the corpusd plugin "
            f"supports the NSA backends formats.py lists with SGLANG_NSA_FUSE_TOPK=0"
        )
        assert cb.base is not None
        h = layer.tp_q_head_num
        q_all = _q_all(q, q_rope, layer)
        n = sel.shape[0]
        o_loc = o.reshape(-1, h, layer.v_head_dim)[:n]
        qc = to_corpusd_layout(q_all[:n]).to(torch.bfloat16)
        base2 = sparse_lse_base2(str(q_all.device))
        o_cor, l_cor = device.corpus_partial(
            cb.resident, layer.layer_id, qc, sel, cb.base[:n], layer.scaling, layer.v_head_dim,
            base2,
        )  # fmt: skip
        merged, _ = lse_mod.merge_local_corpus(o_loc, self._lse[:n], o_cor, l_cor)
        out = o.clone().reshape(-1, h, layer.v_head_dim)
        out[:n] = merged
        return out.view_as(o)

    def _forward(
        self,
        base: Any,
        q: torch.Tensor,
        k: Any,
        v: Any,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool,
        q_rope: Any,
        kw: dict[str, Any],
    ) -> torch.Tensor:
        """SGLang's own attention (``base``, its LSE kept), then the corpus merged in for a
        batch bound to a corpus."""
        cb = self._corpus(forward_batch)
        self._lse = None
        if cb is None:
            return base(q, k, v, layer, forward_batch, save_kv_cache, q_rope=q_rope, **kw)
        if cb.resident is not None:  # the device path: the pools are read in place, here
            one_call = cb.resident.one_call and cb.resident.kv_format != FP8
            if one_call:
                self._one = (layer, cb)  # taken by _forward_flashmla_sparse, if SGLang calls it
            try:
                o = base(q, k, v, layer, forward_batch, save_kv_cache, q_rope=q_rope, **kw)
            finally:
                taken, self._one = self._one is None, None
            if one_call and taken:
                return o  # the one call attended the corpus too
            return self._with_corpus_device(o, q, q_rope, layer, cb)
        begun = self._begin_corpus(q, q_rope, layer, cb)  # in flight during SGLang's partial
        try:
            o = base(q, k, v, layer, forward_batch, save_kv_cache, q_rope=q_rope, **kw)
        except BaseException:
            for _, p in begun[1]:
                cb.link.abandon(p)
            raise
        return self._with_corpus(o, layer, cb, begun)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: Any,
        v: Any,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        q_rope: Any = None,
        **kw: Any,
    ) -> torch.Tensor:
        base = super().forward_extend
        return self._forward(base, q, k, v, layer, forward_batch, save_kv_cache, q_rope, kw)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: Any,
        v: Any,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        q_rope: Any = None,
        **kw: Any,
    ) -> torch.Tensor:
        base = super().forward_decode
        return self._forward(base, q, k, v, layer, forward_batch, save_kv_cache, q_rope, kw)


def _q_all(q: torch.Tensor, q_rope: torch.Tensor | None, layer: Any) -> torch.Tensor:
    """``[n, h, head_dim]``: the absorbed query with its rope band (SGLang's layout)."""
    h = layer.tp_q_head_num
    if q_rope is None:
        return q.reshape(-1, h, layer.head_dim)
    rope = q_rope.reshape(-1, h, layer.head_dim - layer.v_head_dim)
    return torch.cat([q.reshape(-1, h, layer.v_head_dim), rope], -1)


def _tp_size() -> int:
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    return int(get_attention_tp_size())


def _head_slice(layer: Any) -> slice:
    from sglang.srt.layers.dp_attention import get_attention_tp_rank

    h = layer.tp_q_head_num
    r = int(get_attention_tp_rank())
    return slice(r * h, (r + 1) * h)


def create_corpus_nsa_backend(runner: Any) -> CorpusNSABackend:
    """The ``ATTENTION_BACKENDS["nsa"]`` factory (``attention_registry.create_nsa_backend``'s
    signature)."""
    return CorpusNSABackend(runner)
