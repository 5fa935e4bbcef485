"""tools/copy_sanity.py's sequences: the copied stretch comes back whole after its gap, at a
fixed offset with --fixed and at offsets that vary otherwise (the run itself is a script)."""

from __future__ import annotations

import torch

from tools.copy_sanity import batch


def test_the_stretch_comes_back_after_its_gap_and_only_fixed_runs_keep_one_offset() -> None:
    g = torch.Generator().manual_seed(0)
    seq, length, gap = batch(g, 4, 16, fixed=True)
    assert (length, gap) == (24, 0) and seq.shape == (4, 49)
    assert torch.equal(seq[:, 1:25], seq[:, 25:49]) and bool((seq[:, 0] == 1).all())
    offsets = set()
    for _ in range(20):
        seq, length, gap = batch(g, 2, 95, fixed=False)
        assert 8 <= length <= 32 and 0 <= gap <= 64 and seq.shape == (2, 1 + 2 * length + gap)
        assert torch.equal(seq[:, 1 : 1 + length], seq[:, 1 + length + gap :])
        assert int(seq[:, 1 : 1 + length].max()) < 40 + 95
        offsets.add(length + gap)
    assert len(offsets) > 10
