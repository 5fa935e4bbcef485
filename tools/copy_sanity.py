"""Can a checkpoint's architecture learn to copy at all? A check beside ``tools/fit_tiny.py``'s
span fits, none of which has learned to copy (``bench/results/span-fit-proxy-cpu.json``).

Each sequence is BOS, ``L`` random tokens of an ``--alphabet``-symbol range, ``G`` tokens of
another range, then the same ``L`` tokens again; the loss is the copy's (after its first token),
so a uniform guess scores ln(alphabet). ``--fixed``: ``L`` = 24 and ``G`` = 0 always, which a
fixed positional offset solves; otherwise ``L`` and ``G`` are drawn per step, which only
copying by content (an induction circuit) solves. The training forward is the fits' own
(``tools.fit_fast.train_forward_batch``) with their optimiser settings::

    python -m tools.copy_sanity --src /tmp/span/small --steps 1500 --out copy.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from corpusd.model import load_model
from tools.fit_fast import train_forward_batch

COPY_IDS = 200  # the sequences' token ids are below this (stretches from 40, gaps 140..199)


#: The default longest gap between a stretch and its copy (uniform in 0..64).
MAX_GAP = 64


def draw_gap(g: torch.Generator, max_gap: int) -> int:
    """A gap in ``0 … max_gap``: uniform up to :data:`MAX_GAP` (what every earlier run drew),
    log-uniform past it, so the short gaps a copy circuit forms on stay frequent while the
    long ones a span question needs (its quote 100–2,000 tokens back) come too."""
    if max_gap <= MAX_GAP:
        return int(torch.randint(0, max_gap + 1, (), generator=g))
    u = float(torch.rand((), generator=g))
    return min(max_gap, int(math.exp(u * math.log(max_gap + 1))) - 1)


def batch(g: torch.Generator, b: int, alphabet: int, fixed: bool,
          max_gap: int = MAX_GAP) -> tuple[torch.Tensor, int, int]:  # fmt: skip
    """``[b, 1 + 2L + G]`` token ids (BOS 1), and ``L``, ``G``."""
    length = 24 if fixed else int(torch.randint(8, 33, (), generator=g))
    gap = 0 if fixed else draw_gap(g, max_gap)
    x = torch.randint(40, 40 + alphabet, (b, length), generator=g)
    other = torch.randint(140, 200, (b, gap), generator=g)
    return torch.cat([torch.ones(b, 1, dtype=torch.long), x, other, x], dim=1), length, gap


def copy_loss(model: torch.nn.Module, g: torch.Generator, b: int, alphabet: int, fixed: bool,
              device: torch.device, max_gap: int = MAX_GAP) -> torch.Tensor:  # fmt: skip
    """The copy's mean next-token loss on one :func:`batch` (its first token left out: nothing
    predicts it), through the fits' training forward; differentiable."""
    seq, length, gap = batch(g, b, alphabet, fixed, max_gap)
    seq = seq.to(device)
    logits, _ = train_forward_batch(model, seq[:, :-1])  # type: ignore[arg-type]
    s = 1 + length + gap  # the copy's first position
    pred, tgt = logits[:, s : s + length - 1], seq[:, s + 1 : s + length]
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tgt.reshape(-1))


def run(a: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(a.seed)
    g = torch.Generator().manual_seed(a.seed)
    dev = torch.device(a.device)
    model = load_model(a.src, dtype=torch.float32).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    losses: list[float] = []
    t0 = time.monotonic()
    for step in range(a.steps):
        loss = copy_loss(model, g, a.batch, a.alphabet, a.fixed, dev, a.max_gap)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0:
            recent = losses[-100:]
            print(f"step {step:5d}  copy loss (last 100) {sum(recent) / len(recent):.3f}"
                  f"  {time.monotonic() - t0:.0f}s", flush=True)  # fmt: skip
    every = {str(i): round(sum(losses[max(0, i - 100) : i]) / len(losses[max(0, i - 100) : i]), 3)
             for i in range(100, a.steps + 1, 100)}  # fmt: skip
    return {
        "command": "python -m tools.copy_sanity " + " ".join(a.argv),
        "task": "fixed: 24 tokens back to back"
        if a.fixed
        else f"L in 8..32, a gap of 0..{a.max_gap}"
        + (" (log-uniform)" if a.max_gap > MAX_GAP else ""),
        "alphabet": a.alphabet,
        "uniform_nats": math.log(a.alphabet),
        "copy_loss_mean_of_last_100_by_step": every,
        "batch": a.batch,
        "lr": a.lr,
        "device": str(dev),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="a checkpoint (`corpusd model init` writes one)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--alphabet", type=int, default=95, help="symbols the copied tokens draw on")
    ap.add_argument("--fixed", action="store_true", help="24 tokens back to back every time")
    ap.add_argument(
        "--max-gap",
        type=int,
        default=MAX_GAP,
        help="longest gap between a stretch and its copy (past 64: log-uniform)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where to train (cuda:0 on a GPU machine)")
    ap.add_argument("--out", type=Path, default=None, help="append the result to this JSON list")
    a = ap.parse_args(argv)
    a.argv = argv if argv is not None else __import__("sys").argv[1:]
    r = run(a)
    print(json.dumps(r))
    if a.out is not None:
        runs = json.loads(a.out.read_text()) if a.out.exists() else []
        a.out.write_text(json.dumps([*runs, r], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
