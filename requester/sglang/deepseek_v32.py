"""SGLang entry class: ``DeepseekV32ForCausalLM`` that keeps a bound request's corpus out of the
worker's KV pool. Imports sglang; SGLang imports this module through
``SGLANG_EXTERNAL_MODEL_PACKAGE=requester.sglang`` (``models/registry.py``), which happens in
each scheduler process before ``ModelRunner.init_attention_backend`` reads
``ATTENTION_BACKENDS`` — so importing this module also installs the ``nsa`` override.

Written against sglang 0.5.10.post1 and run in a live server (``pytest -m sglang``; NOTES.md).

Per forward: read each request's corpus from its rid (:mod:`.binding`), resolve it once
(coordinator; CorpusBindingError with what to do), shift the own tokens' positions by the
corpus length, and hand the batch's corpus state to the attention backend as
``forward_batch.corpusd``. Each layer's indexer is hooked (instance attributes only) so the index
query reaches the corpus top-k, and so a short own sequence still computes real logits (SGLang
skips them when ``seq_len ≤ index_topk``, but with the corpus the row is longer than that).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import logging
import os
import pstats
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.models.deepseek_v2 import DeepseekV32ForCausalLM as _SGLangDeepseekV32
from sglang.srt.server_args import get_global_server_args

from corpusd.kernels import flashmla, registry
from corpusd.kernels.flashmla import sparse_lse_base2
from corpusd.kernels.formats import D_QK, D_V
from corpusd.model import ModelConfig
from corpusd.model.checkpoint import fingerprint
from requester.predicate import Predicate
from requester.sglang import binding_check, choose, device, dump, formats, model_check
from requester.sglang.backend import CorpusBatch, create_corpus_nsa_backend
from requester.sglang.config import PluginConfig
from requester.sglang.device_scores import warm_up as warm_scores
from requester.sglang.link import CorpusLink
from requester.sglang.metrics import (
    SLOW_PREFILL_LOG,
    PluginMetrics,
    log_triton_compiles,
    serve,
)
from requester.sglang.pagehash import sglang_key_scales_ue8m0
from requester.sglang.positions import INDEX_DIM, ROPE_START, ROPE_WIDTH, shifted_positions
from requester.sglang.resident import Resident

log = logging.getLogger("corpusd.sglang")

# The corpus top-k returns own positions for SGLang to map through its page table, which is the
# unfused path; the fused kernel would return page-table rows instead. An error raised here would
# be swallowed (import_model_classes only logs import errors), so a user's explicit "1" is refused
# in __init__, which is on the model-loading path. (SGLang's variable, not corpusd's.)
os.environ.setdefault("SGLANG_NSA_FUSE_TOPK", "0")
ATTENTION_BACKENDS["nsa"] = create_corpus_nsa_backend


def _hook_indexer(ix: Any, model: DeepseekV32ForCausalLM) -> None:
    """Capture ``(q_fp8, weights)`` on the way into the indexer's top-k (instance attributes;
    SGLang's class is untouched)."""
    for name in ("_get_topk_paged", "_get_topk_ragged"):
        orig = getattr(ix, name)

        def hooked(*args: Any, _orig: Any = orig, _name: str = name, **kw: Any) -> Any:
            # (forward_batch, layer_id, q_fp8, weights, metadata), after enable_dual_stream
            # for _get_topk_ragged.
            a = args[1:] if _name == "_get_topk_ragged" else args
            cb = getattr(a[0], "corpusd", None)
            if cb is not None:
                cb.index_q[a[1]] = (a[2], a[3])
            return _orig(*args, **kw)

        setattr(ix, name, hooked)


class DeepseekV32ForCausalLM(_SGLangDeepseekV32):
    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        args = get_global_server_args()
        if os.environ["SGLANG_NSA_FUSE_TOPK"].lower() in ("1", "true"):
            raise RuntimeError(
                "corpusd plugin: set SGLANG_NSA_FUSE_TOPK=0 (it needs the unfused top-k)"
            )
        mcfg = ModelConfig.from_dir(args.model_path)
        widths = (mcfg.kv_lora_rank, mcfg.qk_rope_head_dim, mcfg.index_head_dim)
        if widths != (ROPE_START, ROPE_WIDTH, INDEX_DIM):
            raise RuntimeError(
                "corpusd plugin: it moves rows in V3.2's layout (kv_lora_rank, qk_rope_head_dim, "
                f"index_head_dim = {ROPE_START}, {ROPE_WIDTH}, {INDEX_DIM}); this model has "
                f"{', '.join(map(str, widths))}"
            )
        raw = json.loads((Path(args.model_path) / "config.json").read_text())
        why = model_check.sglang_cannot_prefill(mcfg.index_n_heads)
        why = why or model_check.sglang_computes_otherwise(raw)
        if why is not None:  # the request's own rows would not be the corpus rows' arithmetic
            raise RuntimeError(f"corpusd plugin: {why} (corpusd's own worker serves it)")
        # The worker's own page format and the backends that keep the LSE (formats.py).
        self.corpusd_kv_format = formats.worker_format(
            str(args.kv_cache_dtype),
            getattr(quant_config, "kv_cache_quant_algo", None),
            formats.model_dtype(str(args.dtype), config),
        )
        formats.check_backends(
            self.corpusd_kv_format, args.nsa_prefill_backend, args.nsa_decode_backend
        )
        # Every CORPUSD_* setting, read and checked once, here at start (config.py).
        self.corpusd_config = cfg = PluginConfig.from_env()
        force = cfg.primitive
        metrics = PluginMetrics()
        trace = str(cfg.trace) if cfg.trace is not None else None
        self.corpusd_link = CorpusLink(
            cfg.coordinator,
            mcfg,
            fingerprint(args.model_path),
            args.page_size,
            chooser=choose.Chooser(
                Predicate(choose.load_profile(cfg.profile), force), metrics, trace
            ),
            cache_bytes=cfg.cache_bytes,
            store=str(cfg.store) if cfg.store is not None else None,
            table_refresh_s=cfg.table_refresh_s,
            holder_deadline_s=cfg.holder_deadline_s or None,
        )
        if cfg.metrics_port is not None:
            serve(metrics, cfg.metrics_port)
        # each bound prefill's timing consults it
        self.corpusd_slow_s = cfg.slow_prefill_s
        if self.corpusd_slow_s is not None:
            log_triton_compiles()  # which kernel a slow prefill compiled, after the warm-up
        self.corpusd_resident = self._device_path(args, mcfg, cfg)
        if self.corpusd_resident is not None and cfg.holder_probe_s > 0:
            # a holder that dies is failed over between steps (device_failover.py)
            self.corpusd_link.watch_holders(self.corpusd_resident, cfg.holder_probe_s)
        if self.corpusd_resident is not None and force == "fetch":
            raise RuntimeError(
                "corpusd plugin: CORPUSD_SGLANG_PRIMITIVE=fetch is for the host path "
                "(CORPUSD_SGLANG_PATH=host): on the device path route already reads the "
                "holders' pools in place on this GPU, and a copy into the page cache would only "
                "add work"
            )
        out = dump.dump_dir()  # a diagnosis aid (tools/diag_layer_diff.py)
        self.corpusd_dumper = dump.Dumper(out) if out is not None else None
        if self.corpusd_dumper is not None:
            dump.install(self, self.corpusd_dumper)
        # an unknown or unservable corpus fails its request at admission, not the forward
        binding_check.register(self)
        binding_check.install()
        self.corpusd_indexers = [
            layer.self_attn.indexer
            for layer in self.model.layers
            if getattr(getattr(layer, "self_attn", None), "indexer", None) is not None
        ]
        for ix in self.corpusd_indexers:
            _hook_indexer(ix, self)
        self._cp_default = [ix.nsa_enable_prefill_cp for ix in self.corpusd_indexers]
        # The corpus's index keys must be quantised as this server quantises its own.
        fmts = {getattr(ix, "scale_fmt", None) for ix in self.corpusd_indexers} or {None}
        assert len(fmts) == 1, f"indexers disagree on scale_fmt: {fmts}"
        self.corpusd_key_ue8m0 = sglang_key_scales_ue8m0(args.page_size, fmts.pop())
        if self.corpusd_resident is not None:
            self.corpusd_resident.ue8m0 = self.corpusd_key_ue8m0
        log.info(
            "corpusd plugin: %d NSA layers hooked, coordinator %s, index key scales %s, %s path, "
            "primitive %s",
            len(self.corpusd_indexers),
            self.corpusd_link.coordinator,
            "ue8m0" if self.corpusd_key_ue8m0 else "fp32",
            "host (gRPC)"
            if self.corpusd_resident is None
            else f"device ({', '.join(sorted(set(self.corpusd_resident.transport.values())))})",
            force
            if self.corpusd_resident is None
            else "route (device path: the pools' selected rows staged on this GPU, "
            f"{self.corpusd_resident.stage_rows} query rows a copy)"
            if self.corpusd_resident.staged
            else "route (device path: pools read in place)",
        )

    def _device_path(self, args: Any, mcfg: ModelConfig, cfg: PluginConfig) -> Resident | None:
        """The device path's tables with this GPU's holders mapped, or None for the host path
        (``CORPUSD_SGLANG_PATH``: ``auto`` takes the device path when a holder shares its pool
        with this GPU, its own or, ``CORPUSD_SGLANG_PEER``, one it reaches by peer access). The
        host path calls holders per layer from the host, which a CUDA graph
        cannot capture, so it needs ``--disable-cuda-graph``."""
        choice = cfg.path
        # the attention's own split over GPUs: 1 under --enable-dp-attention with dp = tp (each
        # rank attends its own requests with every head, as one GPU does), --tp without it
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        tp = int(get_attention_tp_size())
        res = None
        if choice != "host" and tp == 1:
            dev = torch.device("cuda", torch.cuda.current_device())
            res = Resident(
                n_layers=mcfg.num_hidden_layers,
                page_size=args.page_size,
                index_dim=mcfg.index_head_dim,
                arena_tokens=cfg.arena_tokens,
                window_tokens=cfg.window_tokens,
                device=dev,
                ue8m0=True,  # set from the indexers below
                stage_rows=cfg.stage_rows,
                one_call=cfg.one_call,
            )
            mapped = self.corpusd_link.map_holders(res, dev, cfg.peer)
            if not mapped:
                res = None
            else:  # the kernels' LSE bases: probed now, never inside a graph capture
                sparse_lse_base2(str(dev))
                warm_scores(res, dev, mcfg.index_topk)  # a prefill's JIT kernels, compiled now
                if res.one_call:  # its column map, on the GPU before any capture
                    device.sglang_columns(res.pools[0][0].shape[1], dev)
                fmt = res.kv_format
                assert fmt is not None, "holders mapped, but no pool format recorded"
                if fmt == formats.FP8:
                    flashmla.lse_to_natural(str(dev), fp8=True)
                pool = (torch.bfloat16, D_QK, D_V, fmt)
                kernel = registry.choose("auto", str(dev), *pool)
                registry.report(kernel, str(dev), "corpusd plugin (device path)",
                                self.corpusd_link.metrics.kernel,
                                registry.passed_over(kernel, str(dev), *pool))  # fmt: skip
                formats.log_pairing(self.corpusd_kv_format, dict.fromkeys(mapped, fmt))
        if res is None:  # the host path: the holders' formats as the coordinator has them
            try:
                held = self.corpusd_link.holder_formats()
            except Exception as e:  # the first bound request will say what is wrong
                log.warning("corpusd plugin: could not list the holders at start: %s", e)
            else:
                formats.log_pairing(self.corpusd_kv_format, held)
        if res is None and choice == "device":
            raise RuntimeError(
                "corpusd plugin: CORPUSD_SGLANG_PATH=device, but no holder shares its pool with "
                "this GPU (start holders with --device on this GPU and --dtype bfloat16, plain or "
                "--kv-format fp8_e4m3, first; "
                "attention split over GPUs, --tp without --enable-dp-attention, is host path only)"
            )
        if res is None and not args.disable_cuda_graph:
            raise RuntimeError(
                "corpusd plugin: no corpusd holder on this GPU, so corpus attention goes over "
                "gRPC per layer, which a CUDA graph cannot capture: pass --disable-cuda-graph, "
                "or start holders on this GPU before the server"
            )
        return res

    def _device_batch(self, forward_batch: Any, n_tokens: int) -> CorpusBatch | None:
        """The device path's per-token view of the batch. A prefill (never inside a graph)
        records each request slot's corpus in the tables, loading a new corpus first; a decode
        step only reads the tables, so SGLang's captured graphs serve any binding."""
        res = self.corpusd_resident
        assert res is not None
        res.size_requests(int(forward_batch.req_to_token_pool.req_to_token.shape[0]))
        mode = "extend" if forward_batch.forward_mode.is_extend() else "decode"
        if mode == "extend":
            bs = int(forward_batch.batch_size)
            names = binding_check.batch_corpora(getattr(forward_batch, "rids", None), bs)
            link = self.corpusd_link
            # as the binding check bound and loaded them, whatever a recheck forgot since
            bindings = [link.bound(c) if c else None for c in names]
            placed = [link.load_resident(b, res, admitted=True) if b else None for b in bindings]
            res.bind(forward_batch.req_pool_indices[:bs], placed)
            if not any(placed):
                return None
            per_req = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
            base_r, tokens_r = res.rows_of(forward_batch.req_pool_indices[:bs])
            rep = per_req.to(base_r.device)
            base, tokens = base_r.repeat_interleave(rep), tokens_r.repeat_interleave(rep)
        else:
            base, tokens = res.rows_of(forward_batch.req_pool_indices)
            bindings = []
        pad = n_tokens - base.shape[0]  # padded rows (DP attention): unbound
        assert pad >= 0, f"{base.shape=} vs {n_tokens=}"
        if pad:
            base = torch.cat([base, base.new_zeros(pad)])
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
        cb = CorpusBatch(
            self.corpusd_link,
            bindings,
            torch.empty(0, dtype=torch.int64),
            tokens.to(torch.int64),
            self.corpusd_key_ue8m0,
            mode,
        )
        cb.resident, cb.base, cb.tokens = res, base, tokens
        return cb

    def _corpus_batch(
        self, forward_batch: Any, n_tokens: int, device: torch.device
    ) -> CorpusBatch | None:
        bs = int(forward_batch.batch_size)
        names = binding_check.batch_corpora(getattr(forward_batch, "rids", None), bs)
        if not any(names):
            return None
        bindings = [self.corpusd_link.bound(c) if c else None for c in names]
        if forward_batch.forward_mode.is_extend():
            per_req = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
        else:
            per_req = torch.ones(bs, dtype=torch.int64)
        t = torch.tensor([b.tokens if b else 0 for b in bindings], dtype=torch.int64)
        assert int(per_req.sum()) <= n_tokens, f"{per_req.tolist()=} vs {n_tokens=}"
        pad = n_tokens - int(per_req.sum())  # padded rows (DP attention): unbound, T = 0
        token_req = torch.repeat_interleave(torch.arange(bs), per_req)
        token_req = torch.cat([token_req, torch.full((pad,), bs)])  # request bs = none
        corpus_len = torch.cat(
            [torch.repeat_interleave(t, per_req), torch.zeros(pad, dtype=torch.int64)]
        )
        mode = "extend" if forward_batch.forward_mode.is_extend() else "decode"
        ue8m0 = self.corpusd_key_ue8m0
        self.corpusd_link.new_step([str(r) for r in forward_batch.rids or ()], mode)
        cb = CorpusBatch(self.corpusd_link, bindings, token_req, corpus_len, ue8m0, mode)
        cb.base2 = device.type == "cuda" and sparse_lse_base2(str(device))
        return cb

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: Any,
        input_embeds: Any = None,
        pp_proxy_tensors: Any = None,
    ) -> Any:
        idle = forward_batch.forward_mode.is_idle()
        t0 = time.perf_counter()
        if self.corpusd_resident is not None and not idle:
            cb = self._device_batch(forward_batch, positions.shape[0])
        else:
            cb = self._corpus_batch(forward_batch, positions.shape[0], positions.device)
        if cb is not None and cb.mode == "extend":
            cb.link.timings.add("bind (extend)", time.perf_counter() - t0)
        forward_batch.corpusd = cb
        args = (input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        dumper = self.corpusd_dumper  # CORPUSD_SGLANG_DUMP: a diagnosis aid, eager forwards only
        if dumper is None or idle or torch.cuda.is_current_stream_capturing():
            return self._forward(cb, *args)
        # logical positions: own tokens after their corpus, as the selections are recorded
        dump.begin_forward(dumper, forward_batch, None if cb is None else cb.corpus_len)
        if cb is not None:
            cb.dump = dumper
        try:
            return self._forward(cb, *args)
        finally:
            dumper.end()

    def _forward(
        self, cb: CorpusBatch | None, input_ids: torch.Tensor, positions: torch.Tensor,
        forward_batch: Any, input_embeds: Any, pp_proxy_tensors: Any,
    ) -> Any:  # fmt: skip
        for ix, default in zip(self.corpusd_indexers, self._cp_default, strict=True):
            # True only keeps forward_cuda off its "seq_len <= index_topk" shortcut (no logits);
            # the context-parallel branch still needs nsa_cp_metadata, which stays None.
            ix.nsa_enable_prefill_cp = default or cb is not None
        if cb is None:
            return super().forward(
                input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors
            )
        # corpus_len is per token: own tokens sit after their corpus (positions.py).
        shift = cb.corpus_len.to(positions.device)
        shifted = (positions + shift[: positions.shape[0]]).to(positions.dtype)
        with (
            shifted_positions(forward_batch, shifted),
            _timed_extend(cb, positions, self.corpusd_slow_s),
        ):
            return super().forward(
                input_ids, shifted, forward_batch, input_embeds, pp_proxy_tensors
            )


@contextlib.contextmanager
def _timed_extend(cb: CorpusBatch, positions: torch.Tensor, slow_s: float | None) -> Iterator[None]:
    """A bound prefill's forward, timed on the host (kernel launches, and any JIT compile of a
    shape not seen before) and on the GPU (CUDA events, read at the timings' next flush); one
    that holds the host over a second is logged at once with its shape. Decode steps (graph
    replays) are not timed. With ``slow_s`` (``CORPUSD_SGLANG_PROFILE_SLOW``, a diagnosis aid)
    each bound prefill is profiled on the host and waited for, and one whose wall time passes
    ``slow_s`` is logged with its GPU time and host profile."""
    if cb.mode != "extend" or not positions.is_cuda or torch.cuda.is_current_stream_capturing():
        yield
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prof = cProfile.Profile() if slow_s is not None else None
    t0 = time.perf_counter()
    start.record()
    if prof is not None:
        prof.enable()
    yield
    if prof is not None:
        prof.disable()
    end.record()
    host = time.perf_counter() - t0
    cb.link.timings.add("forward (extend) host", host)
    if prof is not None:
        end.synchronize()
    wall = time.perf_counter() - t0
    if wall <= (slow_s or 1.0):
        cb.link.timings.add_gpu("forward (extend) gpu", start, end)
        return
    end.synchronize()  # already slow: say how much of it was the GPU's
    log.warning(
        SLOW_PREFILL_LOG,
        positions.shape[0], sum(b is not None for b in cb.bindings), host,
        start.elapsed_time(end), 1e3 * (time.perf_counter() - t0),
    )  # fmt: skip
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        log.warning("corpusd plugin: where that prefill's host time went:\n%s", text.getvalue())


EntryClass = [DeepseekV32ForCausalLM]
