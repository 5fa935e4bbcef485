"""Per-layer dumps of a forward's last rows, for comparing stock SGLang with route layer by layer
(``tools/diag_layer_diff.py``, ``tools/bench_sglang.py --dump``): a diagnosis aid, on only when
``CORPUSD_SGLANG_DUMP`` names a directory (corpusd/env.py).

Per forward, for each request's **last row** (the position whose next token the forward
predicts: the last extend token, or the decode token), and per layer:

- ``sel``: int64, the indexer's selected keys as **logical positions** ascending (stock: the
  row's positions in its prompt; route: corpus ``0 … T−1``, own token ``j`` at ``T + j``, so
  the two are comparable);
- ``scores``: float32 ``[L]``, the index score of every key the row could select, in logical
  order (``L`` = the row's position + 1);
- ``attn``: float32 ``[hidden]``, the attention block's output (after ``o_proj``);
- ``hidden``: float32 ``[hidden]``, the layer's output residual stream (SGLang's layers return
  ``(hidden, residual)`` with the add deferred: their sum).

A record is ``{"rid", "position", "layers": {layer: {...}}}``; each forward writes one
``torch.save`` file of its records, ``<ns>-<pid>-<n>.pt`` (a sorted listing is in time order).
Nothing here imports sglang: the hooks take SGLang's objects as arguments (:func:`install`), the
arithmetic is CPU-testable.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from corpusd import env

ENV_DUMP = "CORPUSD_SGLANG_DUMP"
#: Only requests whose rid contains this are recorded (the tools name their teacher-forced
#: requests so, ``tools/layer_compare.py: tag``): a server's other traffic writes nothing.
MARK = "diag"


def dump_dir() -> Path | None:
    """The directory ``CORPUSD_SGLANG_DUMP`` names (created), or None when unset."""
    d = env.get(ENV_DUMP)
    if d is None:
        return None
    Path(d).mkdir(parents=True, exist_ok=True)
    return Path(d)


def last_rows(extend_lens: list[int] | None, batch: int) -> list[int]:
    """Row index (in the forward's flattened tokens) of each request's last token: the running
    sum of ``extend_lens`` minus one (an extend), else one row per request (a decode)."""
    if extend_lens is None:
        return list(range(batch))
    return [int(x) - 1 for x in itertools.accumulate(extend_lens)]


@dataclass
class Dumper:
    """Collects one forward's records (:meth:`begin` … :meth:`end`); per layer the hooks call
    :meth:`selection` and :meth:`tensor` with the forward's rows."""

    out: Path
    rids: list[str] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # last row of each request
    positions: list[int] = field(default_factory=list)  # its logical position
    layers: list[dict[int, dict[str, torch.Tensor]]] = field(default_factory=list)
    written: int = 0

    def begin(self, rids: list[str], rows: list[int], positions: list[int]) -> None:
        """Open a forward: of its requests (``rids``, their last ``rows`` and logical
        ``positions``) only those whose rid contains :data:`MARK` are recorded."""
        keep = [i for i, r in enumerate(rids) if MARK in r]
        self.rids = [rids[i] for i in keep]
        self.rows = [rows[i] for i in keep]
        self.positions = [positions[i] for i in keep]
        self.layers = [{} for _ in keep]

    def _slot(self, req: int, layer: int) -> dict[str, torch.Tensor]:
        return self.layers[req].setdefault(layer, {})

    def tensor(self, layer: int, kind: str, t: torch.Tensor) -> None:
        """``t [rows, d]``: the forward's rows of ``kind`` (``attn``, ``hidden``) at ``layer``."""
        for i, r in enumerate(self.rows):
            if r < t.shape[0]:
                self._slot(i, layer)[kind] = t[r].detach().float().cpu()

    def selection(
        self, layer: int, row: int, sel: torch.Tensor, scores: torch.Tensor | None
    ) -> None:
        """Row ``row`` (of the forward's tokens) selected logical positions ``sel`` (``-1``
        ignored) with ``scores`` in logical order; kept when ``row`` is a request's last row."""
        if row not in self.rows:
            return
        i = self.rows.index(row)
        s = sel.detach().long().cpu()
        slot = self._slot(i, layer)
        slot["sel"] = s[s >= 0].sort().values
        if scores is not None:
            slot["scores"] = scores.detach().float().cpu()

    def end(self) -> Path | None:
        """Write the forward's records; the file, or None when there were none."""
        if not self.rids:
            return None
        recs = [
            {"rid": rid, "position": pos, "layers": lay}
            for rid, pos, lay in zip(self.rids, self.positions, self.layers, strict=True)
        ]
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{time.time_ns()}-{os.getpid()}-{self.written:06d}.pt"
        torch.save(recs, path)
        self.written += 1
        self.rids = []
        return path


def load(directory: Path) -> list[dict[str, Any]]:
    """Every record under ``directory``, in the order written."""
    out: list[dict[str, Any]] = []
    for p in sorted(Path(directory).glob("*.pt")):
        out += torch.load(p, weights_only=True)
    return out


def hidden_of(output: Any) -> torch.Tensor:
    """A decoder layer's output as one tensor: SGLang's ``(hidden, residual)`` summed (the add
    its next layer fuses), or the tensor itself."""
    if isinstance(output, tuple):
        h, res = output[0], output[1] if len(output) > 1 else None
        return h if res is None else h + res
    return output


def install(model: Any, dumper: Dumper) -> None:
    """Forward hooks on SGLang's ``model.model.layers[i]`` (``hidden``) and their ``self_attn``
    (``attn``); they record into ``dumper`` while a forward is open (:meth:`Dumper.begin`)."""
    for li, layer in enumerate(model.model.layers):

        def on_attn(_m: Any, _a: Any, out: Any, _li: int = li) -> None:
            if dumper.rids:
                dumper.tensor(_li, "attn", out[0] if isinstance(out, tuple) else out)

        def on_layer(_m: Any, _a: Any, out: Any, _li: int = li) -> None:
            if dumper.rids:
                dumper.tensor(_li, "hidden", hidden_of(out))

        layer.self_attn.register_forward_hook(on_attn)
        layer.register_forward_hook(on_layer)


def begin_forward(dumper: Dumper, forward_batch: Any, offset: torch.Tensor | None = None) -> None:
    """Open a forward from SGLang's ``ForwardBatch``: its rids, each request's last row, and that
    row's logical position (its sequence position plus ``offset[row]``, route's corpus length per
    token; None: 0)."""
    rids = [str(r) for r in (getattr(forward_batch, "rids", None) or [])]
    ext = getattr(forward_batch, "extend_seq_lens_cpu", None)
    mode = getattr(forward_batch, "forward_mode", None)
    decode = mode is not None and bool(getattr(mode, "is_decode", lambda: False)())
    rows = last_rows(None if decode or ext is None else list(ext), len(rids))
    pos = forward_batch.positions
    logical = [int(pos[r]) + (int(offset[r]) if offset is not None else 0) for r in rows]
    dumper.begin(rids, rows, logical)


def stock_selection(
    dumper: Dumper, layer: int, logits: torch.Tensor, lengths: torch.Tensor,
    starts: torch.Tensor | None, result: torch.Tensor,
) -> None:  # fmt: skip
    """Stock's unfused top-k (``fast_topk_v2``: row ``i``'s positions ``0 … lengths[i] − 1``, its
    scores at columns ``starts[i] + j``, ``-1`` padded) into ``dumper``."""
    for row in dumper.rows:
        if row >= logits.shape[0]:
            continue
        n = int(lengths[row])
        s0 = int(starts[row]) if starts is not None else 0
        dumper.selection(layer, row, result[row], logits[row, s0 : s0 + n])
