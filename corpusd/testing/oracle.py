"""The two sides of every end-to-end comparison: transformers' greedy ``generate`` on
[corpus + suffix] (the oracle) and corpusd's Worker decoding the same suffixes against holders.

The oracle runs with corpusd's tie rule (:func:`lowest_position_ties`): transformers' indexer
ends in ``index_scores.topk(k)``, whose choice among exactly equal scores at the cut is
``torch.topk``'s own, and a key every index head scores ≤ 0 scores exactly 0 after the ReLU, so
with few index heads such ties reach the cut (issue 36: 0–5 rows of 904 per layer with 8 index
heads at 1,000 tokens, up to 0.76 relative in the logits). corpusd takes the lowest positions
(``indexer/select.py``); the patched oracle does too, and counts the ties, so a test that
passes says whether ties were there to decide."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from corpusd.corpus.store import PageStore
from requester.config import WorkerConfig
from requester.sampling import SamplingParams
from requester.worker import Worker

Run = tuple[list[int], list[torch.Tensor]]  # greedy tokens, and the logits of each step


@dataclass
class Ties:
    """Exact ties at the indexer's top-k cut met by the oracle: ``rows[layer]`` counts query rows
    whose ``k``-th and ``(k+1)``-th best index scores are equal and not masked (so a tie rule
    chose among real keys), over every forward run under :func:`lowest_position_ties`."""

    rows: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.rows.values())


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``scores.topk(k, dim=-1)`` with the lowest positions first among equal scores (a stable
    descending sort): (values, indices, bool "tie at the cut" per row, shape ``scores[..., 0]``)."""
    srt = scores.sort(dim=-1, descending=True, stable=True)
    vals, idx = srt.values[..., :k], srt.indices[..., :k]
    if k < scores.shape[-1]:
        kth, nxt = srt.values[..., k - 1], srt.values[..., k]
        # transformers masks the future by adding finfo.min (a finite, equal score for every
        # masked key), so only a cut above that is a tie among real keys
        tie = (kth == nxt) & (kth > torch.finfo(kth.dtype).min / 2)
    else:
        tie = torch.zeros(scores.shape[:-1], dtype=torch.bool, device=scores.device)
    return vals, idx, tie


@contextlib.contextmanager
def lowest_position_ties(ties: Ties | None = None) -> Iterator[Ties]:
    """Inside: transformers' ``DeepseekV32Indexer`` selects with :func:`stable_topk` (corpusd's
    tie rule) instead of ``torch.topk``, and counts each layer's ties into ``ties`` (yielded;
    a fresh :class:`Ties` when None). Patches ``torch.Tensor.topk`` only while an indexer's
    forward runs (its last op is the one ``topk``), and restores both on exit."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    got = Ties() if ties is None else ties
    cls = m.DeepseekV32Indexer
    orig_forward, orig_topk = cls.forward, torch.Tensor.topk
    layer: list[int] = []

    def topk(self: torch.Tensor, k: int, dim: int = -1, *args: Any, **kw: Any) -> Any:
        if not layer or dim not in (-1, self.dim() - 1) or args or kw.get("largest") is False:
            return orig_topk(self, k, dim, *args, **kw)
        vals, idx, tie = stable_topk(self, k)
        got.rows[layer[-1]] = got.rows.get(layer[-1], 0) + int(tie.sum())
        return torch.return_types.topk((vals, idx))

    def forward(self: Any, *args: Any, **kw: Any) -> Any:
        layer.append(int(self.layer_idx))
        try:
            return orig_forward(self, *args, **kw)
        finally:
            layer.pop()

    cls.forward = forward  # type: ignore[method-assign]
    torch.Tensor.topk = topk  # type: ignore[method-assign,assignment]
    try:
        yield got
    finally:
        cls.forward = orig_forward  # type: ignore[method-assign]
        torch.Tensor.topk = orig_topk  # type: ignore[method-assign]


def greedy(
    hf_model: Any, corpus: torch.Tensor, suffixes: Sequence[str], new: int,
    ties: Ties | None = None, guess: Sequence[Sequence[int]] | None = None,
) -> list[Run]:  # fmt: skip
    """transformers' ``new`` greedy tokens and their logits for each ``[corpus + suffix bytes]``
    (``hf_model``: a ``DeepseekV32ForCausalLM`` in eval mode), under corpusd's tie rule
    (:func:`lowest_position_ties`; the ties met are added to ``ties`` when given).

    ``guess``: per suffix, tokens believed to be that answer (the decode under test's). Greedy
    tokens are exactly the tokens each of which is the model's argmax after the ones before, so
    one teacher-forced forward over ``[corpus + suffix + guess]`` checks a guess and yields
    every step's logits at once (:func:`_forced`); from the first step whose argmax is not the
    guess, ``generate`` continues as it would have. The result is transformers' greedy either
    way: one forward instead of ``new`` when the guess is right (transformers re-expands the
    whole latent cache at every step, ~0.6 s a token at 700 tokens on one CPU thread)."""
    guesses = _per_suffix(guess, len(suffixes))
    out = []
    for sfx, g in zip(suffixes, guesses, strict=True):
        ids = torch.cat([corpus.to(torch.int64), torch.tensor(list(sfx.encode()))])
        tokens, logits = _forced(hf_model, ids, list(g or [])[:new], ties)
        if len(tokens) < new:
            more, more_logits = _generate(
                hf_model, torch.cat([ids, torch.tensor(tokens, dtype=torch.int64)]),
                new - len(tokens), ties,
            )  # fmt: skip
            tokens, logits = tokens + more, logits + more_logits
        out.append((tokens, logits))
    return out


class Oracle:
    """:func:`greedy` for one model, corpus, suffixes and answer length, computed as far as it is
    asked and kept: ``runs(guess, n)`` is each suffix's first ``n`` greedy tokens (and logits),
    ``guess`` the decode under test's tokens (whole answers or prefixes) to check by one forward
    each. A module fixture's oracle then costs a forward per suffix when the decode is right,
    and is transformers' greedy either way."""

    def __init__(self, hf_model: Any, corpus: torch.Tensor, suffixes: Sequence[str], new: int):
        self._hf, self._corpus, self._suffixes, self.new = hf_model, corpus, list(suffixes), new
        self._runs: list[Run] = [([], []) for _ in self._suffixes]

    def runs(self, guess: Sequence[Sequence[int]] | None = None, n: int | None = None) -> list[Run]:
        guesses = _per_suffix(guess, len(self._suffixes))
        return [self.answer(i, g, n) for i, g in enumerate(guesses)]

    def answer(self, i: int, guess: Sequence[int] | None = None, n: int | None = None) -> Run:
        """Suffix ``i``'s first ``n`` (default all) greedy tokens and logits."""
        n = self.new if n is None else n
        if not 0 <= n <= self.new:
            raise ValueError(f"n={n}: 0 to {self.new} tokens")
        have = self._runs[i][0]
        if len(have) < n:  # the longer of the guess and the greedy tokens known so far
            g = list(guess or [])[:n]
            g = g if len(g) > len(have) else have
            self._runs[i] = greedy(self._hf, self._corpus, [self._suffixes[i]], n, guess=[g])[0]
        tokens, logits = self._runs[i]
        return tokens[:n], logits[:n]

    def tokens(
        self, guess: Sequence[Sequence[int]] | None = None, n: int | None = None
    ) -> list[list[int]]:
        return [tokens for tokens, _ in self.runs(guess, n)]


def _per_suffix(
    guess: Sequence[Sequence[int]] | None, n: int
) -> list[Sequence[int] | None]:  # fmt: skip
    """One guess (or None) per suffix; ValueError when ``guess`` has not ``n``."""
    if guess is None:
        return [None] * n
    if len(guess) != n:
        raise ValueError(f"{len(guess)} guesses for {n} suffixes")
    return list(guess)


def _generate(hf_model: Any, ids: torch.Tensor, new: int, ties: Ties | None) -> Run:
    """``generate``'s ``new`` greedy tokens after ``ids`` (1-D), and each step's logits."""
    ids = ids[None]
    with torch.no_grad(), lowest_position_ties(ties):
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
    return g.sequences[0, ids.shape[1] :].tolist(), [lg[0] for lg in g.logits]


def _forced(hf_model: Any, ids: torch.Tensor, guess: list[int], ties: Ties | None) -> Run:
    """The greedy tokens after ``ids`` (1-D) that one teacher-forced forward over ``ids +
    guess`` establishes, with their logits: the guess up to its first token that is not the
    argmax there, then that argmax (``torch.argmax``'s pick, as ``generate``'s); empty for an
    empty guess."""
    if not guess:
        return [], []
    full = torch.cat([ids, torch.tensor(guess[:-1], dtype=torch.int64)])[None]
    with torch.no_grad(), lowest_position_ties(ties):
        step = hf_model(full, attention_mask=torch.ones_like(full), use_cache=False).logits[0]
    step = step[ids.numel() - 1 :]  # row j: the logits after ids + guess[:j]
    picks = step.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for want, pick in zip(guess, picks, strict=True):
        tokens.append(pick)
        if pick != want:
            break
    return tokens, [step[j] for j in range(len(tokens))]


async def decode(
    model: Any,
    store: PageStore,
    cid: str,
    addresses: list[str],
    cfg: WorkerConfig,
    suffixes: Sequence[str],
    new: int,
    beside: Callable[[Worker], Awaitable[None]] | None = None,
) -> tuple[list[list[int]], list[list[torch.Tensor]], Worker]:
    """A Worker bound to ``cid`` on the holders at ``addresses`` decodes ``new`` tokens of every
    suffix at once; (tokens, logits, the closed worker for its metrics and trace). ``beside``:
    a coroutine run alongside the decode (given the worker; cancelled when the decode ends), e.g.
    one that kills a holder at a step."""
    w = Worker(model, cfg, store=store)
    try:
        await w.attach(cid, addresses)
        params = SamplingParams(max_tokens=new)
        sessions = [
            w.open(cid, list(s.encode()), params=params, keep_logits=True) for s in suffixes
        ]
        aside = asyncio.ensure_future(beside(w)) if beside is not None else None
        try:
            await w.generate(sessions)
        finally:
            if aside is not None:  # done with the decode, whether it did its part or not
                aside.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await aside
        return [s.generated for s in sessions], [s.logits or [] for s in sessions], w
    finally:
        await w.close()
