"""fastmha's CPU kernels compute, per chunk of queries, only the keys between the first and the last one that
some query of the chunk can see (padding and causality skipped), and read no mask where none of those keys
is masked. Skipping must change no result: each mask kind below, in every dtype, forward and backward, with
and without kept weights, against the oracle. Query chunks are 128 rows at these lengths, so Lq = 260 gives
three chunks, the last one partial.
"""

import pytest
import torch
from conftest import assert_close
from oracle import oracle_attention

import fastmha

B, H, LQ, LK, D = 3, 2, 260, 70, 8
CHUNK = 128


def padding(lengths, left=False):
    keys = torch.arange(LK)
    rows = [(keys >= LK - n) if left else (keys < n) for n in lengths]
    return torch.stack(rows)[:, None, None, :]


def mask_cases():
    causal = torch.ones(LQ, LK, dtype=torch.bool).tril()
    dead_at_edges = padding([20, 5, LK]).expand(B, 1, LQ, LK).clone()
    for row in (0, CHUNK - 1, CHUNK, 2 * CHUNK - 1, LQ - 1):  # rows with no visible key, at chunk edges
        dead_at_edges[1, 0, row] = False
    holes = torch.rand(LQ, LK) > 0.3
    holes[:, 40:] = False  # and a padded tail
    return {
        "all visible": torch.ones(B, 1, 1, LK, dtype=torch.int64),
        "all masked": torch.zeros(B, 1, 1, LK, dtype=torch.int64),
        "right padding (int)": padding([LK, 1, 23]).to(torch.int64),
        "left padding": padding([LK, 1, 23], left=True),
        "padding and causal (B, 1, Lq, Lk)": (padding([30, 1, 64]) & causal).to(torch.int64),
        "holes and padding (Lq, Lk)": holes,
        "rows with no key at chunk edges": dead_at_edges,
        "per query, broadcast over keys": (torch.arange(LQ) % 3 != 0).reshape(1, 1, LQ, 1),
        "only the last key": torch.arange(LK) == LK - 1,
        "only the first key, float": (torch.arange(LK) == 0).to(torch.float32),
        "transposed storage": padding([9, 33, LK]).reshape(B, LK).t().contiguous().t()[:, None, None, :],
    }


def causal_and(mask, is_causal):
    if not is_causal:
        return mask
    return (mask != 0) & torch.ones(LQ, LK, dtype=torch.bool).tril()


@pytest.mark.parametrize("case", list(mask_cases()))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_skipped_keys_change_no_result(monkeypatch, case, is_causal, need_weights, dtype):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    mask = mask_cases()[case]
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype, requires_grad=True) for n in (LQ, LK, LK))
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, need_weights, is_causal)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref_inputs, causal_and(mask, is_causal))
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad.double())
    assert_close(out, ref_out, dtype)
    if need_weights:
        assert_close(weights, ref_weights, dtype)
        assert (weights[ref_weights == 0] == 0).all()  # exact zeros where skipped or masked
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype)


def test_nan_value_under_a_causally_skipped_key_propagates_like_the_oracle():
    # The oracle multiplies the value by a weight of 0, and 0 * NaN is NaN: skipping must not clean it.
    q, k, v = (torch.randn(1, 2, 200, 8, dtype=torch.float64) for _ in range(3))
    v[0, 1, 199, 3] = float("nan")
    out, weights = torch.ops.fastmha.attention(q, k, v, None, 0.0, True, True)
    ref_out, ref_weights = oracle_attention(q, k, v, torch.ones(200, 200, dtype=torch.bool).tril())
    torch.testing.assert_close(out, ref_out, equal_nan=True)
    torch.testing.assert_close(weights, ref_weights)
    assert torch.isnan(out[0, 1, :, 3]).all() and torch.isfinite(out[0, 0]).all()


def test_dropout_draws_the_same_mask_when_keys_are_skipped():
    # A NaN value under a padded key makes every chunk take all keys; the weights (which do not read the
    # values) and so the dropout draws must be the same as with the padded keys skipped.
    q, k, v = (torch.randn(2, 2, 150, 8, dtype=torch.float32) for _ in range(3))
    mask = padding([LK, 12])[:2].expand(2, 1, 1, LK)
    k, v = k[:, :, :LK], v[:, :, :LK]
    poisoned = v.clone()
    poisoned[1, :, LK - 1] = float("nan")
    torch.manual_seed(5)
    _, skipped = torch.ops.fastmha.attention(q, k, v, mask, 0.3, True, False)
    torch.manual_seed(5)
    _, all_keys = torch.ops.fastmha.attention(q, k, poisoned, mask, 0.3, True, False)
    assert torch.equal(skipped != 0, all_keys != 0)
    torch.testing.assert_close(skipped, all_keys)  # sums over more (zero) terms may round differently
    assert (skipped[1, :, :, 12:] == 0).all() and (skipped[1, :, :, :12] == 0).any()


def test_padded_batches_choose_the_kernel_that_skips():
    # float64 (a float32 forward on AVX-512 runs fastmha's kernel beyond 512 keys anyway).
    lk = 600  # without a mask that pays for skipping, torch's forward runs from 513 keys on
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (64, lk, lk))
    keys = torch.arange(lk)
    heavy = torch.stack([keys < 50, keys < 90])[:, None, None, :]
    light = torch.stack([keys < lk, keys < 560])[:, None, None, :]
    forward = fastmha.explain(q, k, v, heavy, need_weights=False).splitlines()[0]
    assert forward.startswith("forward fastmha-cpu") and "skips" in forward
    assert fastmha.explain(q, k, v, light, need_weights=False).startswith("forward torch-cpu-flash")


def padded_call_and_oracle(q, k, v, mask, grad, need_weights=True):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights = torch.ops.fastmha.attention(*inputs, mask, 0.0, need_weights, False)
    grads = torch.autograd.grad(out, inputs, grad)
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref_inputs, mask)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad)
    torch.testing.assert_close(out, ref_out, equal_nan=True)
    if need_weights:
        torch.testing.assert_close(weights, ref_weights, equal_nan=True)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, equal_nan=True)
    return grads


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("poisoned", ["key under padding", "output gradient row", "query row"])
def test_nan_that_meets_a_zero_gradient_at_skipped_keys_propagates_like_the_oracle(poisoned, need_weights):
    # The math multiplies a skipped key by a zero score gradient (dQ = dS K) and a skipped key's gradients
    # are sums of zeros times dO or Q rows: 0 * NaN is NaN there, so those chunks must take all keys.
    q, k, v = (torch.randn(2, 2, 150, 8, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :LK], v[:, :, :LK]
    mask = padding([LK, 12])[:2]
    grad = torch.randn(2, 2, 150, 8, dtype=torch.float64)
    if poisoned == "key under padding":
        k = k.clone()
        k[1, 0, LK - 1, 2] = float("nan")
    elif poisoned == "output gradient row":
        grad[1, 0, 140, 5] = float("nan")
    else:
        q = q.clone()
        q[1, 0, 3, 1] = float("inf")
    grads = padded_call_and_oracle(q, k, v, mask, grad, need_weights)
    assert any(torch.isnan(g[1, 0]).any() for g in grads)


def test_rows_whose_scores_all_fall_to_minus_1e9_take_the_skipped_keys():
    # Scores of -1e10 at the visible keys: the masked keys' -1e9 dominate the softmax in the math.
    q = torch.full((1, 1, 3, 1), 1e5, dtype=torch.float64)
    k = torch.randn(1, 1, 6, 1, dtype=torch.float64)
    k[0, 0, :2] = -1e5
    v = torch.randn(1, 1, 6, 4, dtype=torch.float64)
    mask = torch.arange(6) < 2
    for is_causal in (False, True):
        out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, is_causal)
        full_mask = mask & torch.ones(3, 6, dtype=torch.bool).tril() if is_causal else mask
        ref_out, ref_weights = oracle_attention(q, k, v, full_mask)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(weights, ref_weights)
