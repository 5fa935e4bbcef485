"""``corpusd/kernels``: one definition of each shared piece (issue 34: the LSE merge was written
five times, the FlashMLA LSE-base probe three, head padding three with different SM rules, the
row constants twice), and the rules of the ones that remain."""

from __future__ import annotations

import ast
import math
from functools import cache
from pathlib import Path

import pytest
import torch

from corpusd.kernels import flashmla, formats
from corpusd.kernels.merge import merge_partials, merge_stacked
from corpusd.kernels.reference import partial_attention
from corpusd.testing.numeric import rel

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("corpusd", "holder", "requester", "indexer")


@cache
def _definitions() -> dict[str, list[str]]:
    """Module-level function and constant names → the files defining them, over the packages."""
    out: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel_path = f.relative_to(ROOT).as_posix()
            if rel_path.startswith("corpusd/v1/"):
                continue
            for node in ast.parse(f.read_text()).body:
                names: list[str] = []
                if isinstance(node, ast.FunctionDef):
                    names = [node.name]
                elif isinstance(node, ast.Assign):
                    targets = [e for t in node.targets for e in getattr(t, "elts", [t])]
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                for n in names:
                    out.setdefault(n, []).append(rel_path)
    return out


@pytest.mark.parametrize(
    "name",
    ["D_QK", "D_V", "ROW_BYTES", "FP8_ROW_BYTES", "KV_FORMATS", "merge_partials",
     "merge_local_corpus_torch", "lse_to_natural", "_sparse_lse_base2", "sparse_lse_base2",
     "pad_heads", "padded_heads", "prefer_triton", "_few_ctas", "to_natural", "row_bytes",
     "online_block", "store_partial", "run_split"],
)  # fmt: skip
def test_each_shared_piece_is_defined_once_in_the_kernel_package(name: str) -> None:
    where = _definitions().get(name, [])
    assert len(where) <= 1, f"{name} defined in {where}"
    assert all(w.startswith("corpusd/kernels/") for w in where), f"{name} outside: {where}"


def test_no_module_imports_a_private_name_of_another() -> None:
    """``triton_fp8`` took ``_DOT_F32`` and ``_LOG2E`` from ``triton_mla``; shared names are
    public now. No ``from x import _name`` between first-party modules."""
    bad = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                first_party = (getattr(node, "module", None) or "").split(".")[0] in PACKAGES
                if isinstance(node, ast.ImportFrom) and first_party:
                    bad += [f"{f.relative_to(ROOT)}: {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    assert not bad, bad


def test_row_format_constants() -> None:
    assert (formats.D_QK, formats.D_V, formats.D_ROPE) == (576, 512, 64)
    assert formats.ROW_BYTES == 512 + 4 * 4 + 2 * 64 == 656
    assert (formats.SCALE_AT, formats.ROPE_AT) == (512, 528)


@pytest.mark.parametrize(
    "h,sm,want", [(1, 9, 64), (16, 9, 64), (64, 9, 64), (65, 9, 128), (128, 9, 128),
                  (16, 10, 128), (64, 10, 128), (128, 10, 128)],
)  # fmt: skip
def test_head_padding_follows_the_sm(h: int, sm: int, want: int) -> None:
    """One rule for FlashMLA's head tile: 64 or 128 on SM90, 128 on SM100 (the plugin's
    SGLang-side padding was "a multiple of 64, of 128 on SM100"; the holder's "64 or 128")."""
    assert flashmla.padded_heads(h, sm) == want
    q = torch.randn(3, h, 8)
    qp = flashmla.pad_heads(q, sm)
    assert qp.shape == (3, want, 8) and torch.equal(qp[:, :h], q)
    assert bool((qp[:, h:] == 0).all())
    assert (qp is q) == (want == h)
    with pytest.raises(AssertionError, match="1 to 128 heads"):
        flashmla.padded_heads(129, sm)


def test_to_natural_scales_base_2_and_empties_inf_and_nan() -> None:
    lse = torch.tensor([[1.0, math.inf, math.nan, -math.inf]])
    assert flashmla.to_natural(lse, base2=True)[0, 0].item() == pytest.approx(math.log(2.0))
    for base2 in (False, True):
        assert bool(torch.isneginf(flashmla.to_natural(lse, base2)[0, 1:]).all())


def test_lse_base_probe_picks_the_factor_or_refuses() -> None:
    ref = torch.randn(2, 8) * 3
    assert flashmla.lse_base(ref, ref, "k") == 1.0
    assert flashmla.lse_base(ref / math.log(2.0), ref, "k") == pytest.approx(math.log(2.0))
    with pytest.raises(RuntimeError, match="k matches neither"):
        flashmla.lse_base(ref * 3, ref, "k")


def test_merge_stacked_is_merge_partials_along_any_dim() -> None:
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    o = torch.randn(4, 3, 5, 16, generator=g)  # [n, splits, h, d_v]
    lse = torch.randn(4, 3, 5, generator=g) * 4
    lse[0, :, 0] = -math.inf  # empty in every split
    lse[1, 1] = -math.inf  # one empty split
    got_o, got_l = merge_stacked(o, lse, dim=1)
    want_o, want_l = merge_partials([(o[:, i], lse[:, i]) for i in range(3)])
    assert torch.equal(torch.isneginf(got_l), torch.isneginf(want_l))
    fin = torch.isfinite(want_l)
    assert rel(got_l[fin], want_l[fin]) <= 1e-6 and rel(got_o, want_o) <= 1e-6
    assert bool((got_o[0, 0] == 0).all())


def _old_sparse_fwd(q, kv, indices, sm_scale, d_v=512):  # type: ignore[no-untyped-def]
    """sgl_kernel's sparse FlashMLA as builds before 0.4.6 declare it (no ``topk_length``), as the
    one an SGLang server brings does: zeros of its output shapes."""
    n, h = q.shape[0], q.shape[1]
    return q.new_zeros(n, h, d_v), q.new_zeros(n, h, dtype=torch.float32), q.new_zeros(n, h)


def test_sparse_flashmla_is_called_without_topk_length_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel build without ``topk_length`` is still called (the plugin's LSE-base probe died on
    it in an SGLang server: "unexpected keyword argument 'topk_length'"), and the variant that
    needs the keyword is not usable there."""
    monkeypatch.setattr(flashmla, "_sparse_fwd", lambda: _old_sparse_fwd)
    q = torch.zeros(3, 16, formats.D_QK, dtype=torch.bfloat16)
    kv = torch.zeros(200, formats.D_QK, dtype=torch.bfloat16)
    indices = torch.tensor([[0, 5, -1], [7, 199, 250], [-1, -1, -1]])
    out, lse, count = flashmla.raw_sparse(q, kv, indices, 0.1)
    assert out.shape == (3, 16, formats.D_V) and lse.shape == (3, 16)
    assert count.tolist() == [2, 2, 0]
    flashmla.takes_lengths.cache_clear()
    assert not flashmla.takes_lengths()
    with pytest.raises(TypeError, match="topk_length"):
        flashmla.raw_sparse(q, kv, indices, 0.1, prep=flashmla.prep_lengths, lengths=True)
    flashmla.takes_lengths.cache_clear()


@pytest.mark.parametrize("h", [64, 128, 160, 300])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_flashmla_kernel_runs_past_128_heads_per_group_of_128(
    monkeypatch: pytest.MonkeyPatch, h: int, fp8: bool
) -> None:
    """A model of more than 128 heads (a valid V3.2 config may have 160) is attended by the
    registry's FlashMLA kernel one call per group of at most 128 heads, joined along the heads:
    the reference over all heads at once. The FlashMLA calls are stood in for by the reference
    (no GPU here) and fail past 128 heads as FlashMLA's do."""
    calls: list[int] = []

    def one_call(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int,
                 **_: object) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        flashmla.padded_heads(q.shape[1])  # FlashMLA's own limit: 128 heads a call
        assert q.is_contiguous()
        calls.append(q.shape[1])
        return partial_attention(q, kv, idx, scale, d_v)

    monkeypatch.setattr(flashmla, "fp8_sparse_partial" if fp8 else "sparse_partial", one_call)
    g = torch.Generator().manual_seed(h)
    q, kv = torch.randn(3, h, 24, generator=g), torch.randn(40, 24, generator=g)
    idx = torch.randint(-1, 40, (3, 16), generator=g)
    if fp8:
        kv = kv.to(torch.uint8)  # the dtype that routes to the fp8 call; the stand-in reads it
    for fn in (flashmla.flashmla_partial_attention, flashmla.flashmla_lengths_partial_attention):
        calls.clear()
        o, lse = fn(q, kv, idx, 0.2, 16)
        want_o, want_lse = partial_attention(q, kv, idx, 0.2, 16)
        torch.testing.assert_close(o, want_o, rtol=1e-6, atol=1e-6)  # per head: one softmax
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
        assert calls == [min(128, h - i) for i in range(0, h, 128)]
