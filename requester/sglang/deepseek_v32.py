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

import logging
import os
from typing import Any

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.models.deepseek_v2 import DeepseekV32ForCausalLM as _SGLangDeepseekV32
from sglang.srt.server_args import get_global_server_args

from corpusd.model import ModelConfig
from corpusd.model.checkpoint import fingerprint
from requester.sglang.backend import CorpusBatch, create_corpus_nsa_backend
from requester.sglang.binding import corpora_of_batch
from requester.sglang.link import CorpusLink
from requester.sglang.pagehash import sglang_key_scales_ue8m0
from requester.sglang.positions import INDEX_DIM, ROPE_START, ROPE_WIDTH, shift_positions

log = logging.getLogger("corpusd.sglang")

# The corpus top-k returns own positions for SGLang to map through its page table, which is the
# unfused path; the fused kernel would return page-table rows instead. An error raised here would
# be swallowed (import_model_classes only logs import errors), so a user's explicit "1" is refused
# in __init__, which is on the model-loading path.
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
        if not args.disable_cuda_graph:
            raise RuntimeError(
                "corpusd plugin: pass --disable-cuda-graph (a corpus partial is an "
                "RPC per layer; it cannot be captured in a CUDA graph)"
            )
        mcfg = ModelConfig.from_dir(args.model_path)
        widths = (mcfg.kv_lora_rank, mcfg.qk_rope_head_dim, mcfg.index_head_dim)
        if widths != (ROPE_START, ROPE_WIDTH, INDEX_DIM):
            raise RuntimeError(
                "corpusd plugin: it moves rows in V3.2's layout (kv_lora_rank, qk_rope_head_dim, "
                f"index_head_dim = {ROPE_START}, {ROPE_WIDTH}, {INDEX_DIM}); this model has "
                f"{', '.join(map(str, widths))}"
            )
        self.corpusd_link = CorpusLink(
            os.environ.get("CORPUSD_COORDINATOR", ""),
            mcfg,
            fingerprint(args.model_path),
            args.page_size,
        )
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
        log.info(
            "corpusd plugin: %d NSA layers hooked, coordinator %s, index key scales %s",
            len(self.corpusd_indexers),
            self.corpusd_link.coordinator,
            "ue8m0" if self.corpusd_key_ue8m0 else "fp32",
        )

    def _corpus_batch(self, forward_batch: Any, n_tokens: int) -> CorpusBatch | None:
        bs = int(forward_batch.batch_size)
        names = corpora_of_batch(getattr(forward_batch, "rids", None), bs)
        if not any(names):
            return None
        bindings = [self.corpusd_link.bind(c) if c else None for c in names]
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
        return CorpusBatch(self.corpusd_link, bindings, token_req, corpus_len, ue8m0, mode)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: Any,
        input_embeds: Any = None,
        pp_proxy_tensors: Any = None,
    ) -> Any:
        cb = self._corpus_batch(forward_batch, positions.shape[0])
        forward_batch.corpusd = cb
        for ix, default in zip(self.corpusd_indexers, self._cp_default, strict=True):
            # True only keeps forward_cuda off its "seq_len <= index_topk" shortcut (no logits);
            # the context-parallel branch still needs nsa_cp_metadata, which stays None.
            ix.nsa_enable_prefill_cp = default or cb is not None
        if cb is not None:
            # corpus_len is already per token (shift_positions with one token per "request").
            ones = torch.ones_like(cb.corpus_len)
            positions = shift_positions(positions, cb.corpus_len, ones).to(positions.dtype)
            forward_batch.positions = positions
        return super().forward(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)


EntryClass = [DeepseekV32ForCausalLM]
