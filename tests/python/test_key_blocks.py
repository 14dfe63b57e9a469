"""Without kept weights, fastmha's CPU kernels walk each chunk's keys in blocks: the forward with an online
softmax (a running row max and sum, the output rescaled whenever the max grows), the backward block by block
from the saved log-sum-exp. FASTMHA_CPU_KEY_BLOCK sets the block size, so these short sequences cross many
block edges (blocks of 16 and 24 keys against 70 or 100 keys: full, partial and single blocks). Each case runs
the own kernels against the float64 oracle, forward and backward.
"""

import math
import re

import pytest
import torch
from conftest import assert_close
from oracle import oracle_attention
from philox_reference import expected_keep

B, H, LQ, LK, D = 2, 2, 45, 70, 8
BLOCKS = ["16", "24", "1", ""]  # "": the size chosen from the L2 cache (one block here)


@pytest.fixture(params=BLOCKS, ids=lambda b: f"block={b or 'auto'}")
def key_block(request, monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", request.param)
    return request.param


def padding(lengths):
    return (torch.arange(LK)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


def mask_cases():
    causal = torch.ones(LQ, LK, dtype=torch.bool).tril()
    no_key_rows = padding([LK, 30]).expand(B, 1, LQ, LK).clone()
    no_key_rows[1, 0, [0, 17, LQ - 1]] = False  # uniform over all keys (the -1e9 rule)
    holes = torch.rand(LQ, LK) > 0.5  # masked keys inside blocks, and blocks masked in some rows only
    holes[:, 16:40] = False  # two whole blocks of 16 (one of 24) hidden from every row
    return {
        "none": None,
        "padding": padding([LK, 19]).to(torch.int64),
        "padding and causal": (padding([50, 3]) & causal).to(torch.int64),
        "rows with no key": no_key_rows,
        "holes and hidden blocks": holes,
    }


def full_mask(mask, is_causal, shape=(B, H, LQ, LK)):
    lq, lk = shape[2], shape[3]
    visible = torch.ones(shape, dtype=torch.bool)
    if mask is not None:
        visible = visible & (mask != 0)
    if is_causal:
        visible = visible & torch.ones(lq, lk, dtype=torch.bool).tril()
    return visible


def check_against_oracle(q, k, v, mask, is_causal, dtype, dropout=0.0):
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, _, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, mask, dropout, False, is_causal)
    keep = None
    if dropout > 0:
        seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
        keep = expected_keep(seed, offset, (q.size(0), q.size(1), q.size(2), k.size(2)), dropout)
    grad = torch.randn_like(out)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref, full_mask(mask, is_causal, (*q.shape[:3], k.size(2))), keep, dropout)
    assert_close(out, ref_out, dtype)
    if dropout > 0:
        return  # the op's own backward redraws the mask; test_backward_with_dropout checks it
    got = torch.autograd.grad(torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, is_causal)[0], (q, k, v), grad)
    want = torch.autograd.grad(ref_out, ref, grad.double())
    for g, w in zip(got, want):
        assert_close(g, w, dtype)


@pytest.mark.parametrize("case", list(mask_cases()))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_blocks_match_the_oracle(key_block, case, is_causal, dtype):
    q, k, v = torch.randn(B, H, LQ, D), torch.randn(B, H, LK, D), torch.randn(B, H, LK, D)
    check_against_oracle(q, k, v, mask_cases()[case], is_causal, dtype)


@pytest.mark.parametrize("lk", [1, 15, 16, 17, 48, 100])
def test_lengths_around_block_edges(key_block, lk):
    q, k, v = torch.randn(B, H, LQ, D), torch.randn(B, H, lk, D), torch.randn(B, H, lk, D)
    check_against_oracle(q, k, v, None, False, torch.float64)
    check_against_oracle(q, k, v, None, True, torch.float32)


@pytest.mark.parametrize("order", ["rising", "falling"])
def test_online_rescaling_over_a_wide_score_range(key_block, order):
    # Scores from about -60 to 60 along the keys: rising, every block raises the row max and the output so
    # far must be rescaled by a factor that underflows for early blocks; falling, the first block holds it.
    ramp = torch.linspace(-60.0, 60.0, LK)
    if order == "falling":
        ramp = ramp.flip(0)
    q = torch.zeros(B, H, LQ, D)
    q[..., 0] = math.sqrt(D)
    k = torch.zeros(B, H, LK, D)
    k[..., 0] = ramp
    k[..., 1:] = 0.1 * torch.randn(B, H, LK, D - 1)
    v = torch.randn(B, H, LK, D)
    for dtype in (torch.float64, torch.float32):
        check_against_oracle(q, k, v, None, False, dtype)


def test_dropout_draws_and_values(key_block):
    q, k, v = torch.randn(B, H, LQ, D), torch.randn(B, H, LK, D), torch.randn(B, H, LK, D)
    for case in ("none", "padding and causal"):
        check_against_oracle(q, k, v, mask_cases()[case], case != "none", torch.float64, dropout=0.3)


def test_backward_with_dropout(key_block):
    # Forward and backward under one seed against the oracle given the same keep mask.
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (LQ, LK, LK))
    for case in ("padding", "rows with no key"):
        out, got, ref_out, want = dropout_grads_and_oracle(q, k, v, mask_cases()[case], 0.3)
        assert_close(out, ref_out, torch.float64)
        for g, w in zip(got, want):
            assert_close(g, w, torch.float64)


def test_non_finite_scores_in_later_blocks(key_block):
    q, k, v = torch.randn(1, 1, 4, D).abs(), torch.randn(1, 1, LK, D), torch.randn(1, 1, LK, D)
    k[0, 0, 60, 0] = float("nan")  # a NaN score in the last block: rows 0..3 are NaN in the math
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
    assert out.isnan().all()
    k[0, 0, 60, 0] = float("inf")  # +inf scores (q > 0): softmax divides inf by inf
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
    assert out.isnan().all()
    k[0, 0, 60, 0] = 0.0
    k[0, 0, :24, 0] = float("-inf")  # whole first blocks scoring -inf weigh 0; the rest is finite
    out, _ = torch.ops.fastmha.attention(q.double(), k.double(), v.double(), None, 0.0, False, False)
    ref, _ = oracle_attention(q.double(), k.double(), v.double())
    assert ref.isfinite().all()
    assert_close(out, ref, torch.float64)


def dropout_grads_and_oracle(q, k, v, mask, p, grad_seed=1):
    """The op's gradients under one seed, and the oracle's given the same keep mask (from the Philox stream)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(5)
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, p, False, False)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    torch.manual_seed(5)
    _, _, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, mask, p, False, False)
    seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
    keep = expected_keep(seed, offset, (q.size(0), q.size(1), q.size(2), k.size(2)), p)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref, full_mask(mask, False, (*q.shape[:3], k.size(2))), keep, p)
    return out, got, ref_out, torch.autograd.grad(ref_out, ref, grad.double())


def test_float16_output_that_overflows_keeps_finite_gradients(key_block):
    # With dropout a float16 output can round to inf (values near its range, scaled by 1 / (1 - p)); the math's
    # gradients do not use the output and stay finite, so the backward must not take D = dO . O from it.
    q, k = torch.randn(1, 2, 6, D), torch.randn(1, 2, 4, D)
    v = torch.full((1, 2, 4, D), 40000.0)
    out, got, ref_out, want = dropout_grads_and_oracle(q.half(), k.half(), v.half(), None, 0.5)
    assert out.isinf().any() and ref_out.isfinite().all()
    for g, w in zip(got, want):
        assert g.isfinite().all()
        torch.testing.assert_close(g.double(), w, atol=1e-2 * float(w.abs().max()) + 1e-3, rtol=1e-2)


def test_rows_whose_scores_are_all_minus_infinity_are_nan_like_the_math(key_block):
    # q row 3 holds +inf against keys whose first component is negative: all its scores are -inf, so its
    # softmax is NaN, and so is every value gradient it feeds (not a uniform row: no key is masked).
    q, k, v = torch.randn(1, 1, 6, D, dtype=torch.float64), torch.randn(1, 1, LK, D, dtype=torch.float64), torch.randn(
        1, 1, LK, D, dtype=torch.float64)
    k[..., 0] = -k[..., 0].abs() - 0.5
    q[0, 0, 3, 0] = float("inf")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.fastmha.attention(*inputs, None, 0.0, False, False)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref)
    want = torch.autograd.grad(ref_out, ref, grad)
    assert ref_out[0, 0, 3].isnan().all() and want[2].isnan().all()
    assert torch.equal(out.isnan(), ref_out.isnan())
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan())
        torch.testing.assert_close(g.nan_to_num(), w.nan_to_num())


@pytest.mark.parametrize("layout", ["heads and rows swapped", "every other row"])
def test_strided_inputs(key_block, layout):
    def strided(n):
        if layout == "heads and rows swapped":
            return torch.randn(B, n, H, D).transpose(1, 2)  # (B, H, n, D) over (B, n, H, D) storage
        return torch.randn(B, H, 2 * n, D)[:, :, ::2]
    q, k, v = strided(LQ), strided(LK), strided(LK)
    assert not q.is_contiguous()
    check_against_oracle(q, k, v, mask_cases()["padding"], False, torch.float64)


def test_empty_inputs(key_block):
    for lq, lk in ((0, LK), (LQ, 0), (0, 0)):
        q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True) for n in (lq, lk, lk))
        out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
        assert out.shape == (B, H, lq, D) and (out == 0).all()
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert all((g == 0).all() for g in grads)


def test_backward_splits_of_one_head_add_up(key_block):
    # Four threads on one head: the backward splits the query chunks into ranges with partial dK/dV each.
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        q, k, v = torch.randn(1, 1, 600, D), torch.randn(1, 1, LK, D), torch.randn(1, 1, LK, D)
        mask = (torch.rand(600, LK) > 0.2).reshape(1, 1, 600, LK)
        check_against_oracle(q, k, v, mask, True, torch.float64)
    finally:
        torch.set_num_threads(threads)


def test_same_output_as_the_kept_weights_path(key_block):
    # With kept weights the kernel computes whole score rows in one pass; both paths are the same softmax.
    q, k, v = torch.randn(B, H, LQ, D), torch.randn(B, H, LK, D), torch.randn(B, H, LK, D)
    mask = mask_cases()["holes and hidden blocks"]
    blocked, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, True)
    whole, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, True)
    torch.testing.assert_close(blocked, whole, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("value", ["0", "-16", "abc", "16k", "+16", " 16", "99999999999999999999"])
def test_bad_block_size_is_named(monkeypatch, value):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", value)
    q = torch.randn(1, 1, 4, D)
    with pytest.raises(RuntimeError, match=re.escape(f"FASTMHA_CPU_KEY_BLOCK must be a positive number of keys, got '{value}'")):
        torch.ops.fastmha.attention(q, q, q, None, 0.0, False, False)
