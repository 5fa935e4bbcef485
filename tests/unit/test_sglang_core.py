"""The SGLang plugin's pure logic against corpusd's torch reference (CPU; no sglang needed)."""

from __future__ import annotations

import math

import pytest
import torch

from corpusd.kernels.merge import merge_partials
from corpusd.kernels.reference import partial_attention
from corpusd.model.rope import Rotary, apply_interleaved
from corpusd.model.tiny import TINY
from corpusd.testing.numeric import rel
from indexer import select_topk
from indexer.fp8 import hadamard
from requester.sglang import binding, lse, pagehash, positions, topk
from requester.sglang.binding import CorpusBindingError, PinnedCorpus

SCALE = 576**-0.5


def _kv(seed: int, rows: int = 400, n: int = 6, h: int = 8):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, 576, generator=g), torch.randn(rows, 576, generator=g), g


# -- LSE conventions and merge ------------------------------------------------------------------
def _sglang_local(q, kv, idx):  # type: ignore[no-untyped-def]
    """The local partial as FlashMLA's sparse prefill hands it over: base-2 LSE, +inf if empty."""
    o, l_nat = partial_attention(q, kv, idx, SCALE, 512)
    return o, torch.where(torch.isinf(l_nat), math.inf, l_nat / math.log(2.0))


def test_local_plus_corpus_equals_partial_over_union() -> None:
    q, kv, g = _kv(1)
    t = 250  # corpus rows 0..249, the request's own rows 250..399
    corpus_idx = torch.stack([torch.randperm(t, generator=g)[:40] for _ in range(6)])
    own_idx = torch.stack([t + torch.randperm(150, generator=g)[:30] for _ in range(6)])
    own_idx[1] = -1  # a row that selected nothing of its own
    corpus_idx[2] = -1  # a row that selected nothing of the corpus
    own_idx[3] = corpus_idx[3] = -1  # a row empty on both sides
    want_o, want_l = partial_attention(q, kv, torch.cat([corpus_idx, own_idx], 1), SCALE, 512)

    o_loc, raw = _sglang_local(q, kv, own_idx)
    l_loc = lse.to_natural(raw, base2=True)
    o_cor, l_cor = partial_attention(q, kv, corpus_idx, SCALE, 512)  # corpusd: natural, -inf
    o, lse_m = lse.merge_local_corpus(o_loc, l_loc, o_cor, l_cor)

    assert (
        rel(o, want_o) < 1e-5
        and rel(lse_m[~torch.isinf(want_l)], want_l[~torch.isinf(want_l)]) < 1e-6
    )
    assert torch.equal(torch.isinf(lse_m), torch.isinf(want_l)) and bool(
        torch.isinf(lse_m[3]).all()
    )
    assert bool((o[3] == 0).all()) and not bool(o.isnan().any())
    ref_o, ref_l = merge_partials([(o_loc, l_loc), (o_cor, l_cor)])
    assert rel(o, ref_o) < 1e-6 and torch.equal(torch.isinf(ref_l), torch.isinf(lse_m))
    # Without the base-2 conversion the merge is wrong: the test can fail.
    bad, _ = lse.merge_local_corpus(o_loc, raw.float(), o_cor, l_cor)
    both = [0, 4, 5]  # rows with both parts non-empty
    assert rel(bad[both], want_o[both]) > 1e-2


def _merge_state_reference(pa, la, pb, lb):  # type: ignore[no-untyped-def]
    """sglang/srt/layers/attention/triton_ops/merge_state.py's kernel, in torch: +inf is read
    as -inf, then max-shifted exp weights (NaN when both are empty)."""
    la = torch.where(la == math.inf, -math.inf, la)
    lb = torch.where(lb == math.inf, -math.inf, lb)
    m = torch.maximum(la, lb)
    ea, eb = torch.exp(la - m), torch.exp(lb - m)
    s = ea + eb
    return pa * (ea / s)[..., None] + pb * (eb / s)[..., None], torch.log(s) + m


def test_merge_state_convention_with_repair_equals_reference() -> None:
    q, kv, g = _kv(2)
    a = torch.stack([torch.randperm(200, generator=g)[:20] for _ in range(6)])
    b = torch.stack([200 + torch.randperm(200, generator=g)[:20] for _ in range(6)])
    a[0] = -1
    a[4] = b[4] = -1
    pa, la = partial_attention(q, kv, a, SCALE, 512)
    pb, lb = partial_attention(q, kv, b, SCALE, 512)
    o, l_m = _merge_state_reference(pa, lse.to_merge_state(la), pb, lse.to_merge_state(lb))
    assert bool(o[4].isnan().all())  # what merge_state itself leaves for an all-empty row
    o, l_m = lse.repair_empty(o, lse.from_merge_state(l_m), torch.isinf(la) & torch.isinf(lb))
    want_o, want_l = merge_partials([(pa, la), (pb, lb)])
    assert rel(o, want_o) < 1e-6 and torch.equal(torch.isinf(l_m), torch.isinf(want_l))
    fin = ~torch.isinf(want_l)
    assert rel(l_m[fin], want_l[fin]) < 1e-6


def test_decode_layout_round_trip() -> None:
    g = torch.Generator().manual_seed(3)
    b, s_q, h = 3, 2, 4
    o = torch.randn(b, s_q, h, 8, generator=g)
    l3 = torch.randn(b, h, s_q, generator=g)
    o_r, l_r = lse.decode_rows(o, l3)
    for i in range(b):
        for j in range(s_q):
            assert torch.equal(o_r[i * s_q + j], o[i, j]) and torch.equal(
                l_r[i * s_q + j], l3[i, :, j]
            )
    assert torch.equal(lse.rows_to_decode(l_r, b), l3)


def test_to_natural() -> None:
    x = torch.tensor([[1.0, math.inf, float("nan"), -math.inf]])
    assert torch.equal(
        lse.to_natural(x, base2=True),
        torch.tensor([[math.log(2.0), -math.inf, -math.inf, -math.inf]]),
    )


# -- positions and rope layout ------------------------------------------------------------------
def test_shift_positions() -> None:
    pos = torch.tensor([0, 1, 2, 0, 1, 5])
    got = positions.shift_positions(pos, torch.tensor([100, 0, 7]), torch.tensor([3, 2, 1]))
    assert got.tolist() == [100, 101, 102, 0, 1, 12]
    with pytest.raises(AssertionError):
        positions.shift_positions(pos, torch.tensor([1, 2]), torch.tensor([3, 2]))


def _runner_pattern(model_forward: object) -> tuple[object, list[torch.Tensor]]:
    """SGLang's ``CudaGraphRunner.capture_one_batch_size``: one ForwardBatch, two warm-up runs
    and the capture, each called as ``forward(forward_batch.positions, forward_batch)``."""
    from types import SimpleNamespace

    static = torch.tensor([3, 4, 5])  # the runner's positions buffer
    fb = SimpleNamespace(positions=static)
    seen = [model_forward(fb.positions, fb) for _ in range(3)]  # type: ignore[operator]
    return fb, seen


def test_shifted_positions_leave_the_graph_runners_buffer_in_place() -> None:
    """The entry model's forward (deepseek_v32.py) shifts positions inside
    ``shifted_positions``: every run sees the static buffer + the corpus length, never a
    shift of a shift, and the batch's positions are the runner's buffer again afterwards (the
    issue 17 graph defect: the capture read a freed warm-up tensor)."""
    shift = torch.tensor([100, 100, 0])

    def forward(pos: torch.Tensor, fb: object) -> torch.Tensor:
        with positions.shifted_positions(fb, pos + shift) as shifted:
            assert fb.positions is shifted  # type: ignore[attr-defined]
            return shifted

    fb, seen = _runner_pattern(forward)
    assert all(s.tolist() == [103, 104, 5] for s in seen), [s.tolist() for s in seen]
    assert fb.positions.tolist() == [3, 4, 5]  # type: ignore[attr-defined]

    def raising(pos: torch.Tensor, fb: object) -> None:
        with positions.shifted_positions(fb, pos + shift):
            raise RuntimeError("a layer failed")

    from types import SimpleNamespace

    fb2 = SimpleNamespace(positions=torch.tensor([1]))
    before = fb2.positions
    with pytest.raises(RuntimeError):
        raising(fb2.positions, fb2)
    assert fb2.positions is before


def _sglang_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """SGLang's non-neox (GPT-J) rotary, as RotaryEmbedding applies it with is_neox_style=False:
    rotate pairs (x[2i], x[2i+1]) in place, keeping them interleaved."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


def test_rope_layouts_agree_with_our_rotary() -> None:
    rot = Rotary(TINY)
    g = torch.Generator().manual_seed(4)
    p = torch.randint(0, 5000, (10,), generator=g)
    x = torch.randn(10, 3, 64, generator=g)
    cos, sin = rot.cos_sin(p)
    ours = apply_interleaved(x, cos, sin)  # corpusd / transformers layout
    theirs = _sglang_rope(x, cos, sin)  # SGLang's pool layout
    assert torch.allclose(positions.deinterleave(theirs), ours, atol=1e-6)
    assert torch.equal(positions.interleave(positions.deinterleave(theirs)), theirs)


def test_corpus_partial_of_a_sglang_query_equals_ours() -> None:
    """A query prefilled by SGLang at logical position T + i (shifted), moved to corpusd's layout,
    attends the corpus's canonical rows (k_pe rotated by our model at 0..T-1) exactly as our
    own model's query does."""
    rot = Rotary(TINY)
    g = torch.Generator().manual_seed(5)
    t, n, h = 300, 4, 8
    own_pos = torch.tensor([0, 3, 17, 40])
    logical = positions.shift_positions(own_pos, torch.tensor([t]), torch.tensor([n]))
    q_nope = torch.randn(n, h, 512, generator=g)
    q_pe_raw = torch.randn(n, h, 64, generator=g)  # interleaved pairs, before rotation
    c_kv = torch.randn(t, 512, generator=g)
    k_pe = apply_interleaved(torch.randn(t, 1, 64, generator=g), *rot.cos_sin(torch.arange(t)))
    kv = torch.cat([c_kv, k_pe[:, 0]], 1)  # corpusd's rows
    idx = torch.stack([torch.randperm(t, generator=g)[:64] for _ in range(n)])

    cos, sin = rot.cos_sin(logical)
    q_ours = torch.cat([q_nope, apply_interleaved(q_pe_raw, cos, sin)], -1)
    q_sglang = torch.cat([q_nope, _sglang_rope(q_pe_raw, cos, sin)], -1)
    want = partial_attention(q_ours, kv, idx, SCALE, 512)
    got = partial_attention(positions.to_corpusd_layout(q_sglang), kv, idx, SCALE, 512)
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-6
    unshifted = rot.cos_sin(own_pos)  # forgetting the shift changes the scores
    q_bad = torch.cat([q_nope, _sglang_rope(q_pe_raw, *unshifted)], -1)
    assert (
        rel(partial_attention(positions.to_corpusd_layout(q_bad), kv, idx, SCALE, 512)[0], want[0])
        > 1e-3
    )


# -- combined top-k -----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_combined_topk_equals_select_topk_over_the_concatenation(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n, k, t_max, own_len = 7, 16, 60, 40
    corpus_len = torch.randint(0, t_max + 1, (n,), generator=g)
    corpus_len[0] = 0  # an unbound request
    # Integer scores: plenty of ties at the cut, where the lowest logical position must win.
    cs = torch.randint(0, 6, (n, t_max), generator=g).float()
    osc = torch.randint(0, 6, (n, own_len), generator=g).float()
    own_limit = torch.randint(1, own_len + 1, (n,), generator=g)
    # Reference: one row [corpus ‖ own] in logical order, the row sees T + own_limit positions.
    want = torch.full((n, k), -1, dtype=torch.int64)
    for i in range(n):
        t = int(corpus_len[i])
        row = torch.cat([cs[i, :t], osc[i]])[None]
        want[i] = select_topk(row, k, torch.tensor([t + int(own_limit[i])]))[0]
    # Corpus candidates from three "holders" (contiguous page ranges), each its own top-k, with
    # one range held twice (a replica): repeats count once.
    parts = []
    for lo, hi in ((0, 20), (20, 45), (45, t_max), (20, 45)):
        s = cs.clone()
        mask = torch.zeros(t_max, dtype=torch.bool)
        mask[lo:hi] = True
        s[:, ~mask] = -math.inf
        p = select_topk(s, k, corpus_len)
        parts.append((p, s.gather(1, p.clamp(min=0)).masked_fill(p < 0, -math.inf)))
    cpos = torch.cat([p for p, _ in parts], 1)
    cscore = torch.cat([s for _, s in parts], 1)
    own_pos, own_s = topk.own_candidates(osc, own_limit, k)
    got = topk.combined_topk(own_pos, own_s, cpos, cscore, corpus_len, k)
    assert torch.equal(got, want), f"{seed=}\n{got=}\n{want=}"

    c_sel, o_sel = topk.split_selection(got, corpus_len)
    for i in range(n):
        t = int(corpus_len[i])
        sel = got[i][got[i] >= 0]
        assert sorted(
            c_sel[i][c_sel[i] >= 0].tolist() + (o_sel[i][o_sel[i] >= 0] + t).tolist()
        ) == sorted(sel.tolist())
        assert bool((c_sel[i][c_sel[i] >= 0] < t).all()) and bool(
            (o_sel[i][o_sel[i] >= 0] < int(own_limit[i])).all()
        )


# -- binding ------------------------------------------------------------------------------------
def test_request_binding_round_trip_and_radix_separation() -> None:
    f = binding.request_fields("sample-repo")
    assert binding.corpus_of_rid(f["rid"]) == "sample-repo"
    assert f["extra_key"] == "corpusd:sample-repo"
    assert binding.corpus_of_rid("a1b2c3") is None and binding.corpus_of_rid(None) is None
    # The radix cache matches only equal extra keys: two corpora, and an unbound request
    # (extra_key None), never share a cached prefix.
    assert len({binding.extra_key("a"), binding.extra_key("b"), None}) == 3
    assert binding.request_fields("a", rid="x") != binding.request_fields("a", rid="y")
    assert binding.corpora_of_batch([f["rid"], "plain"], 3) == ["sample-repo", None, None]
    for bad in ("corpusd:repo", "corpusd::x", "corpusd:repo:"):
        with pytest.raises(CorpusBindingError, match=r"corpusd:<corpus>:<unique>|corpus name"):
            binding.corpus_of_rid(bad)
    with pytest.raises(CorpusBindingError, match="without ':'"):
        binding.request_fields("a:b")


def _pinned(**kw: object) -> PinnedCorpus:
    base: dict = dict(
        corpus_id="ab12cd34ef56" + "0" * 20,
        name="repo",
        state="ready",
        tokens=8028,
        page_size=64,
        model_fingerprint="sha256:aa",
    )
    base.update(kw)
    return PinnedCorpus(**base)


def test_resolve_corpus_and_its_errors() -> None:
    c = _pinned()
    b = binding.resolve("repo", [c], "sha256:aa", 64)
    assert (b.corpus_id, b.tokens) == (c.corpus_id, 8028)
    assert binding.resolve("ab12cd34", [c], "sha256:aa", 64).corpus_id == c.corpus_id
    cases = [
        ("nope", [c], "sha256:aa", 64, "unknown corpus 'nope'; pinned: repo"),
        ("repo", [_pinned(state="pinning")], "sha256:aa", 64, "is pinning, not ready"),
        (
            "repo",
            [c],
            "sha256:bb",
            64,
            "pinned for model sha256:aa, but this SGLang server runs sha256:bb",
        ),
        ("repo", [c], "sha256:aa", 128, "64-token pages; this server's --page-size is 128"),
        ("repo", [c, _pinned(corpus_id="ff" * 16)], "sha256:aa", 64, "ambiguous"),
        ("repo", [_pinned(state="retired")], "sha256:aa", 64, "unknown corpus"),
    ]
    for name, corpora, fp, ps, msg in cases:
        with pytest.raises(CorpusBindingError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            binding.resolve(name, corpora, fp, ps)


# -- page hashes and host layout ----------------------------------------------------------------
def test_page_hashes_equal_sglang_get_hash_str() -> None:
    # Golden values from sglang 0.5.10.post1's own get_hash_str (hicache_storage.py), chained
    # over 64-token pages as HiCacheController._storage_hit_query does.
    toks = [(i * 7919 + 13) % 129280 for i in range(200)]
    assert pagehash.page_hashes(toks) == [
        "e0815952436f55ed9294a70a622f8e8e198d01d48d9e5e8e712953788238a036",
        "c1c75e4e5795a040217cdbeb7f531ed6e8b6b00736a5579c2e02c1d50637e970",
        "bd9dba464fae1dd7312c454da46097720675f18977b3b027d32265141884331b",
    ]  # 200 tokens: three whole pages; the partial fourth has no key
    assert pagehash.page_hash([0, 1, 2, 2**32 - 1]) == (
        "8eb98e5dc91be0043765dab820052016d078f57beae8de3657271bb0f1317914"
    )


def test_host_kv_page_layouts() -> None:
    g = torch.Generator().manual_seed(6)
    latent = torch.randn(3, 64, 576, generator=g)
    want = positions.to_sglang_layout(latent).bfloat16()  # [layer, token, 576]
    lf = pagehash.host_kv_page(latent, "layer_first", torch.bfloat16).view(3, 64, 1, 576)
    pf = pagehash.host_kv_page(latent, "page_first", torch.bfloat16).view(64, 3, 1, 576)
    assert torch.equal(lf[:, :, 0], want) and torch.equal(pf[:, :, 0].transpose(0, 1), want)
    assert torch.equal(positions.to_corpusd_layout(want.float()), latent.bfloat16().float())
    with pytest.raises(ValueError, match="host layout"):
        pagehash.host_kv_page(latent, "page_head", torch.bfloat16)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_index_k_page_bytes(ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(64, 128, generator=g) * torch.linspace(0.01, 10, 64)[:, None]
    page = pagehash.index_k_page(keys, ue8m0)
    assert page.dtype == torch.uint8 and page.shape == (64 * 128 + 64 * 4,)
    back = pagehash.index_k_from_page(page)
    rotated = hadamard(keys)  # SGLang stores the key after rotate_activation
    assert rel(back, rotated) < 0.04  # fp8 e4m3: 3 mantissa bits
    assert rel(back, keys) > 0.5, "the page holds unrotated keys"
    scales = page[64 * 128 :].view(torch.float32)
    if ue8m0:
        assert bool((torch.log2(scales) == torch.log2(scales).round()).all())
    amax = rotated.abs().amax(1)
    assert torch.allclose(scales, amax / 448, rtol=2e-2 if not ue8m0 else 1.0)
    assert bool((scales >= amax / 448 * 0.99).all())
