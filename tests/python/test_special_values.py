"""NaN, Inf and huge inputs propagate like the oracle; masked positions do not leak NaN into other rows;
repeated calls do not grow memory."""

import gc

import pytest
import torch
from oracle import OracleBlock, oracle_attention

import fastmha


def same_as_oracle(q, k, v, mask=None, is_causal=False):
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, is_causal)
    ref_out, ref_weights = oracle_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref_out, equal_nan=True)
    torch.testing.assert_close(weights, ref_weights, equal_nan=True)
    return out, weights


def qkv(lq=4, lk=6, d=8):
    return [torch.randn(1, 2, n, d, dtype=torch.float64) for n in (lq, lk, lk)]


def test_nan_in_a_masked_key_stays_out_of_the_scores():
    q, k, v = qkv()
    k[0, 0, 3] = float("nan")  # its scores are NaN, but the mask overwrites them with -1e9
    mask = torch.ones(6, dtype=torch.bool)
    mask[3] = False
    out, weights = same_as_oracle(q, k, v, mask)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()


@pytest.mark.parametrize("kernels", ["stock", "own", "auto"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_key_under_the_mask_without_kept_weights(monkeypatch, kernels, value):
    # torch's CPU flash kernel adds the mask as a -inf bias, which a non-finite score turns into NaN; the contract
    # replaces the score with -1e9, so the output stays finite and only the query gradient meets the key (0 * NaN).
    # With 600 keys, most visible, float32 `auto` runs torch's kernel for the forward.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", kernels)
    q, k, v = (torch.randn(1, 2, n, 16) for n in (40, 600, 600))
    k[0, 0, 3, 0] = value
    mask = torch.ones(600, dtype=torch.bool)
    mask[3] = False
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, False)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ref_out, _ = oracle_attention(q64, k64, v64, mask)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), grad_out.double())
    assert ref_out.isfinite().all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4, equal_nan=True)


def test_nan_in_a_query_poisons_only_its_row():
    q, k, v = qkv()
    q[0, 1, 2, 0] = float("nan")
    out, _ = same_as_oracle(q, k, v)
    assert torch.isnan(out[0, 1, 2]).all()
    rows_ok = torch.ones(1, 2, 4, dtype=torch.bool)
    rows_ok[0, 1, 2] = False
    assert torch.isfinite(out[rows_ok]).all()


def test_nan_value_under_a_masked_key_propagates_like_the_oracle():
    # 0 * NaN is NaN in the oracle's weights @ value as well: no silent cleaning of the user's NaN.
    q, k, v = qkv()
    v[0, 0, 5, 0] = float("nan")
    mask = torch.ones(6, dtype=torch.bool)
    mask[5] = False
    same_as_oracle(q, k, v, mask)


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), 1e30, -1e30])
def test_infinite_and_huge_scores(value):
    q, k, v = qkv()
    q[0, 0, 1, 0] = value
    same_as_oracle(q, k, v)


def test_huge_values_in_float32_stay_finite_where_the_oracle_does():
    q, k, v = (t.float() for t in qkv())
    q *= 1e3
    out, weights = torch.ops.fastmha.attention(q, k, v)
    ref_out, ref_weights = oracle_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(weights.double(), ref_weights, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(out).all()


def test_mask_that_requires_grad_gets_no_gradient():
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = torch.ones(6, dtype=torch.float64, requires_grad=True)
    out, _ = torch.ops.fastmha.attention(q, k, v, mask)
    out.sum().backward()
    assert mask.grad is None and q.grad is not None


def rss_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_repeated_forward_backward_does_not_grow_memory():
    block = fastmha.MultiHeadAttentionBlock(64, 4, 0.1)
    x = torch.randn(4, 96, 64, requires_grad=True)
    mask = torch.rand(4, 1, 1, 96) > 0.2

    def step():
        block(x, x, x, mask).sum().backward()
        block.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(200):  # warm up allocator caches and thread pools
        step()
    gc.collect()
    before = rss_kib()
    for _ in range(1000):
        step()
    gc.collect()
    assert rss_kib() - before < 20 * 1024, "RSS grew by more than 20 MiB over 1000 calls"


def test_rejected_calls_leave_no_memory_behind():
    q = torch.randn(2, 4, 64, 16)
    bad_mask = torch.ones(3, 64)  # does not broadcast: rejected after the inputs are read
    for _ in range(100):
        with pytest.raises(RuntimeError):
            torch.ops.fastmha.attention(q, q, q, bad_mask)
    gc.collect()
    before = rss_kib()
    for _ in range(2000):
        with pytest.raises(RuntimeError):
            torch.ops.fastmha.attention(q, q, q, bad_mask)
        with pytest.raises(RuntimeError):
            torch.ops.fastmha.attention(q, q, q, None, 1.5)
    gc.collect()
    assert rss_kib() - before < 10 * 1024, "RSS grew by more than 10 MiB over 4000 rejected calls"


@pytest.mark.parametrize("kernels", ["stock", "own"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_saved_log_sum_exp_is_the_scaled_scores_with_nan_where_one_is_infinite(monkeypatch, kernels, dtype):
    # The forward saves each row's log-sum-exp of the scaled scores, whichever kernel ran, in the query's (B, H, Lq)
    # order whatever the inputs' layout; a row with a +inf score gets NaN (its weights are inf / inf), not +inf.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", kernels)
    q, k, v = (torch.randn(2, n, 3, 16, dtype=dtype).transpose(1, 2) for n in (5, 7, 7))  # heads interleaved
    q[0, 1, 3] = q[0, 1, 3].abs()
    k[0, 1, 2, :] = float("inf")
    _, _, lse, _ = torch.ops.fastmha._attention_forward(q, k, v, None, 0.0, False, False)
    scores = q.double() @ k.double().transpose(-2, -1) / 4.0
    want = torch.logsumexp(scores, -1)
    want = torch.where(want == float("inf"), float("nan"), want)
    assert lse.shape == (2, 3, 5) and lse.is_contiguous()
    assert lse[0, 1, 3].isnan() and torch.isfinite(lse[1]).all()
    torch.testing.assert_close(lse.double(), want, equal_nan=True, atol=2e-3, rtol=1e-3)


def special_case(case):
    """float64 over 600 keys (where `auto` runs torch's CPU flash kernel behind the contract layer), 4 queries."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, n, 8, dtype=torch.float64) for n in (4, 600, 600))
    mask = None
    if case in ("empty sequence, nan key", "empty sequence, inf key", "empty sequence, inf query"):
        mask = (torch.arange(600) < torch.tensor([[600], [0]]))[:, None, None, :]  # batch 1 is all padding
        if case == "empty sequence, inf query":
            q[1, 0, 2, 0] = float("inf")
        else:
            k[1, 0, 5, 0] = float("nan") if case == "empty sequence, nan key" else float("inf")
    else:  # every score of query row 1 is -inf; with a mask the hidden key's -1e9 wins the row
        k[..., 0] = -k[..., 0].abs() - 0.5
        q[0, 0, 1, 0] = float("inf")
        if case == "all scores -inf, one key hidden":
            mask = torch.ones(600, dtype=torch.bool)
            mask[7] = False
    return q, k, v, mask


@pytest.mark.parametrize("kernels", ["stock", "own", "auto"])
@pytest.mark.parametrize("case", ["empty sequence, nan key", "empty sequence, inf key", "empty sequence, inf query",
                                  "all scores -inf", "all scores -inf, one key hidden"])
def test_non_finite_inputs_give_the_oracle_on_every_kernel(monkeypatch, kernels, case):
    # torch's kernel departs from the math only where a result is not finite (a zeroed query row meeting an
    # infinite key, a row whose every score is -inf); the layer then runs fastmha's kernel.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", kernels)
    q, k, v, mask = special_case(case)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, False)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_out, _ = oracle_attention(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad_out)
    torch.testing.assert_close(out, ref_out, equal_nan=True)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("value_entry", [float("inf"), float("nan")])
@pytest.mark.parametrize("call", ["core", "block"])
def test_a_loss_on_the_weights_alone_takes_nothing_from_a_non_finite_value(call, value_entry, create_graph):
    # The value never reaches such a loss, so it cannot make the other gradients NaN (here at a key the mask hides,
    # as a padded position might hold).
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])[:, None, None, :]
    if call == "core":
        q, k, v = (torch.randn(2, 2, n, 4, dtype=torch.float64) for n in (3, 5, 5))
        v[1, :, 4] = value_entry
        inputs = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_()]
        weights = torch.ops.fastmha.attention(*inputs, mask, 0.0, True, False)[1]
        want_weights = oracle_attention(*inputs, mask)[1]
    else:
        block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0).double()
        oracle = OracleBlock(8, 2).double()
        oracle.load_state_dict(block.state_dict())
        x, memory = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
        value = memory.clone()
        value[1, 4] = value_entry
        inputs = [x.requires_grad_(), memory.requires_grad_(), block.w_q.weight, block.w_k.weight]
        block(x, memory, value, mask)
        weights = block.attention_scores
        want_weights = oracle(x, memory, value, mask)[1]
        inputs_of_oracle = [x, memory, oracle.w_q.weight, oracle.w_k.weight]
    grad_weights = torch.randn_like(weights)
    got = torch.autograd.grad(weights, inputs[:2] + inputs[2:], grad_weights, create_graph=create_graph,
                              allow_unused=True)
    want = torch.autograd.grad(want_weights, inputs if call == "core" else inputs_of_oracle, grad_weights,
                               allow_unused=True)
    for got_grad, want_grad in zip(got, want):
        if want_grad is None:  # the value (core): no gradient, or zeros
            assert got_grad is None or not got_grad.any()
            continue
        assert want_grad.isfinite().all()
        torch.testing.assert_close(got_grad, want_grad)
