"""``corpusd.kernels.formats.valid_first``: one holder's share of each row's top-k, valid
indices first at a fixed width (the graph-safe form of ``compact``), exactly what the rows
selected; and FlashMLA's ``topk_length`` preparation built on it."""

from __future__ import annotations

import torch

from corpusd.kernels.formats import valid_first
from corpusd.kernels.reference import partial_attention


def test_valid_first_keeps_each_rows_indices_in_order_and_moves_the_unused_last() -> None:
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 500, (6, 64), generator=g)
    idx[torch.rand(6, 64, generator=g) < 0.6] = -1
    idx[2] = -1  # a row with nothing on this holder
    idx[3] = torch.arange(64)  # a row with everything
    out = valid_first(idx)
    assert out.shape == idx.shape and out.dtype == idx.dtype
    for r in range(6):
        valid = idx[r][idx[r] >= 0]
        assert torch.equal(out[r, : len(valid)], valid), f"row {r}: order kept"
        assert bool((out[r, len(valid) :] == -1).all()), f"row {r}: -1 after"


def test_a_compacted_request_attends_what_the_uncompacted_one_does() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(4, 3, 48, generator=g, dtype=torch.float64)
    kv = torch.randn(90, 48, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 90, (4, 40), generator=g)
    idx[torch.rand(4, 40, generator=g) < 0.5] = -1
    o, lse = partial_attention(q, kv, idx, 0.2, 32)
    oc, lsec = partial_attention(q, kv, valid_first(idx), 0.2, 32)
    # The same rows in another order: partial_attention sums in float32 (whatever q's dtype),
    # and a BLAS sums a row's products in SIMD lanes by column, so moving the rows moves the
    # rounding. Equal to float32's rounding, not bit for bit: on an AMD EPYC the two differed
    # by 3.0e-7 in O and 2.4e-7 in LSE, and a bound of 1e-12 failed there.
    assert torch.allclose(o, oc, rtol=1e-5, atol=1e-6), (o - oc).abs().max()
    assert torch.allclose(lse, lsec, rtol=1e-5, atol=1e-6), (lse - lsec).abs().max()
    # and what was attended is the same set: a dropped or doubled row moves O by far more
    wrong = valid_first(idx).clone()
    wrong[:, 0] = (wrong[:, 0] + 1) % 90
    ow, _ = partial_attention(q, kv, wrong, 0.2, 32)
    assert not torch.allclose(o, ow, rtol=1e-5, atol=1e-6)


def test_flashmla_length_preparation_puts_each_rows_valid_indices_first_with_their_count() -> None:
    """What FlashMLA is given with ``topk_length``: out-of-pool indices and padding -1, each row's
    valid ones first in their order, the count beside; the first ``count`` entries of a row are
    exactly its valid indices, whatever the layout it came in."""
    from corpusd.kernels.flashmla import padded_topk, prep_lengths

    g = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, 700, (5, 200), generator=g)  # 700 > the pool's 600: some outside
    idx[torch.rand(5, 200, generator=g) < 0.5] = -1
    idx[0] = -1
    kp = padded_topk(200)
    out, count = prep_lengths(idx, 600, kp)
    assert out.shape == (5, 1, kp) and out.dtype == torch.int32 and count.dtype == torch.int32
    for r in range(5):
        valid = idx[r][(idx[r] >= 0) & (idx[r] < 600)]
        c = int(count[r])
        assert c == len(valid) and torch.equal(out[r, 0, :c].long(), valid), f"row {r}"
        assert bool((out[r, 0, c:] == -1).all()), f"row {r}: -1 after its count"
