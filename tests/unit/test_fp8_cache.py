"""FlashMLA's 656-byte fp8 latent row (``corpusd/kernels/fp8_cache.py``): its bytes against an
independent re-implementation of SGLang's quantizer (numpy, codes chosen by hand), the round
trip's error bound, and sparse attention over fp8 rows against the bf16 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corpusd.kernels import fp8_cache as f8
from corpusd.kernels.reference import partial_attention
from corpusd.testing.numeric import rel


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % (1 << 31))


def _latent(g: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows with per-tile magnitudes spread over 2^-12 … 2^6 (so tiles land in every binade,
    subnormal codes included), and a few exact zeros inside tiles."""
    x = torch.randn(n, f8.D_QK, generator=g)
    x[:, : f8.D_NOPE] *= (
        torch.exp2(torch.randint(-12, 7, (n, f8.N_TILES, 1), generator=g))
        .repeat(1, 1, f8.TILE)
        .reshape(n, f8.D_NOPE)
    )
    x[:, ::37] = 0.0
    return x.to(dtype)


# -- an independent SGLang quantizer: float32 numpy arithmetic, fp8 codes picked from a table ----


def _e4m3fn_table() -> np.ndarray:
    """Values of codes 0 … 126 (the non-negative finite e4m3fn numbers), by the format's
    definition: exponent bias 7, 3 mantissa bits, subnormals at exponent field 0."""
    vals = []
    for c in range(127):
        e, m = c >> 3, c & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


def _encode_e4m3fn(y: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 ``y`` (|y| ≤ 448) to e4m3fn codes (uint8)."""
    table = _e4m3fn_table()
    a = np.abs(y.astype(np.float64))
    hi = np.clip(np.searchsorted(table, a), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick = np.where(d_lo < d_hi, lo, hi)
    tie = d_lo == d_hi
    pick = np.where(tie, np.where(lo % 2 == 0, lo, hi), pick)
    return (pick | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)  # -0 keeps its sign


def _bf16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 (nearest even) as little-endian bytes, from the bit pattern."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r.astype("<u2").view(np.uint8).reshape(x.shape[0], -1)


def _sglang_quantize(rows: torch.Tensor) -> np.ndarray:
    """SGLang's ``_quantize_k_cache_fast_kernel``, per tile: ``y_s = max|y| / 448``,
    ``fp8(clamp(y · (1/y_s), ±448))``, scale stored as float32, rope copied as bf16."""
    x = rows.float().numpy()
    n = x.shape[0]
    out = np.zeros((n, 656), dtype=np.uint8)
    for t in range(4):
        tile = x[:, t * 128 : (t + 1) * 128].astype(np.float32)
        s = (np.abs(tile).max(axis=1) / np.float32(448.0)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = (np.float32(1.0) / s).astype(np.float32)
            y = np.clip((tile * inv[:, None]).astype(np.float32), -448.0, 448.0)
        y = np.where(s[:, None] > 0, y, 0.0)  # corpusd's one documented difference (zero tiles)
        out[:, t * 128 : (t + 1) * 128] = _encode_e4m3fn(y)
        out[:, 512 + 4 * t : 516 + 4 * t] = s.astype("<f4").view(np.uint8).reshape(n, 4)
    out[:, 528:] = _bf16_bytes(x[:, 512:])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_equal_an_independent_sglang_quantizer(dtype: torch.dtype) -> None:
    x = _latent(_seed(), 300, dtype)
    x[3, :128] = 0.0  # an all-zero tile: scale 0, codes 0
    got = f8.quantize(x).numpy()
    want = _sglang_quantize(x)
    assert got.shape == (300, f8.ROW_BYTES) == (300, 656)
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{dtype=}: {len(bad)} bytes differ, first (row, byte) {bad[:4].tolist()}"
    assert got[3, :128].max() == 0 and got[3, 512:516].view("<f4")[0] == 0.0


def test_layout_offsets_hold_what_the_format_says() -> None:
    """Tile t's scale is float32 at bytes 512 + 4t, the rope band bf16 at 528 …: hand-made row."""
    x = torch.zeros(1, 576)
    for t in range(4):
        x[0, t * 128] = 448.0 * 2.0**t  # tile t: amax 448·2^t → scale 2^t, first code 448
    x[0, 512:] = torch.arange(64) / 4
    b = f8.quantize(x)[0]
    assert b[:512].view(torch.float8_e4m3fn).float()[::128].tolist() == [448.0] * 4
    assert b[512:528].view(torch.float32).tolist() == [1.0, 2.0, 4.0, 8.0]
    assert torch.equal(b[528:].view(torch.bfloat16).float(), torch.arange(64) / 4)
    assert torch.equal(f8.dequantize(b[None])[0], x[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_bound(dtype: torch.dtype) -> None:
    """|x̂ − x| ≤ |x|·(2^-4 + 2^-7) + s·2^-10 per value (half an e4m3 step, the subnormal step,
    two bf16 roundings), and the rope band comes back as bf16(x) exactly."""
    x = _latent(_seed(), 256, dtype).float()
    back = f8.dequantize(f8.quantize(x))
    assert back.dtype == torch.float32 and back.shape == x.shape
    s = (x[:, :512].reshape(-1, 4, 128).abs().amax(-1) / 448.0).repeat_interleave(128, 1)
    err = (back[:, :512] - x[:, :512]).abs()
    bound = x[:, :512].abs() * (2.0**-4 + 2.0**-7) + s * 2.0**-10
    worst = float((err / bound.clamp(min=1e-30)).max())
    assert bool((err <= bound).all()), f"{dtype=}: error {worst:.3f}× its bound"
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).float())
    r = rel(back[:, :512], x[:, :512])
    assert 1e-3 < r < 4e-2, f"{dtype=}: round-trip rel {r:.2e} (fp8 e4m3 is ~2-3 %)"
    assert torch.equal(f8.dequantize(f8.quantize(x), torch.bfloat16).float(), back)


def test_attention_over_fp8_rows() -> None:
    """Exactly the reference over the dequantized pool; within fp8 tolerance of the bf16
    reference; an empty row is O = 0, LSE = -inf; an index past the pool raises."""
    g = _seed()
    n, h, pool, k = 6, 16, 300, 96
    kv = torch.randn(pool, 576, generator=g).bfloat16()
    q = torch.randn(n, h, 576, generator=g)
    idx = torch.randint(0, pool, (n, k), generator=g)
    idx[0] = -1
    idx[2, k // 2 :] = -1
    packed = f8.quantize(kv)
    scale = 576**-0.5
    o, lse = f8.fp8_partial_attention(q, packed, idx, scale, 512)
    ref_o, ref_lse = partial_attention(q, f8.dequantize(packed), idx, scale, 512)
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    assert float(o[0].abs().max()) == 0.0 and bool(torch.isneginf(lse[0]).all())
    bf_o, bf_lse = partial_attention(q, kv.float(), idx, scale, 512)
    err, lse_err = rel(o[1:], bf_o[1:]), float((lse[1:] - bf_lse[1:]).abs().max())
    assert err < 5e-2 and lse_err < 5e-2, f"fp8 vs bf16: O rel {err:.2e}, |LSE| {lse_err:.2e}"
    assert err > 1e-4, "fp8 rows gave bf16's answer: quantization did not happen"
    ob, _ = f8.fp8_partial_attention(q.bfloat16(), packed, idx.int(), scale, 512)
    assert ob.dtype == torch.bfloat16 and rel(ob[1:].float(), o[1:]) < 1e-2
    with pytest.raises(IndexError, match="out of range"):
        f8.fp8_partial_attention(q, packed, idx.index_fill(1, torch.tensor([0]), pool), scale, 512)


@pytest.mark.parametrize(
    "rank,rope,field", [(256, 64, "kv_lora_rank"), (512, 32, "qk_rope_head_dim")]
)
def test_layout_refuses_other_geometries(rank: int, rope: int, field: str) -> None:
    f8.check_layout(512, 64)
    with pytest.raises(ValueError, match=f"needs {field}"):
        f8.check_layout(rank, rope)
