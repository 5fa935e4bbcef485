"""The two sides of every end-to-end comparison: transformers' greedy ``generate`` on
[corpus + suffix] (the oracle) and corpusd's Worker decoding the same suffixes against holders."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from corpusd.corpus.store import PageStore
from requester.config import WorkerConfig
from requester.sampling import SamplingParams
from requester.worker import Worker

Run = tuple[list[int], list[torch.Tensor]]  # greedy tokens, and the logits of each step


def greedy(hf_model: Any, corpus: torch.Tensor, suffixes: Sequence[str], new: int) -> list[Run]:
    """transformers' ``new`` greedy tokens and their logits for each ``[corpus + suffix bytes]``
    (``hf_model``: a ``DeepseekV32ForCausalLM`` in eval mode)."""
    out = []
    for sfx in suffixes:
        ids = torch.cat([corpus.to(torch.int64), torch.tensor(list(sfx.encode()))])[None]
        with torch.no_grad():
            g = hf_model.generate(
                ids,
                # Every position is real: without the mask, generate infers one from
                # pad_token_id and would mask the CPU default's BOS (id 0) as padding.
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        out.append((g.sequences[0, ids.shape[1] :].tolist(), [lg[0] for lg in g.logits]))
    return out


async def decode(
    model: Any,
    store: PageStore,
    cid: str,
    addresses: list[str],
    cfg: WorkerConfig,
    suffixes: Sequence[str],
    new: int,
) -> tuple[list[list[int]], list[list[torch.Tensor]], Worker]:
    """A Worker bound to ``cid`` on the holders at ``addresses`` decodes ``new`` tokens of every
    suffix at once; (tokens, logits, the closed worker for its metrics and trace)."""
    w = Worker(model, cfg, store=store)
    try:
        await w.attach(cid, addresses)
        params = SamplingParams(max_tokens=new)
        sessions = [
            w.open(cid, list(s.encode()), params=params, keep_logits=True) for s in suffixes
        ]
        await w.generate(sessions)
        return [s.generated for s in sessions], [s.logits or [] for s in sessions], w
    finally:
        await w.close()
