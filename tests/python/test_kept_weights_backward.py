"""The CPU backward takes P from the weights a call kept, instead of recomputing the scores.

When a float32 or float64 call keeps its weights (need_weights=True, the drop-in's case) and the loss does not read
them, autograd hands them to the backward op (with dropout, float32 only). With dropout up to 0.1 the weights are P
times the dropout multipliers: the op recovers P from the kept ones and recomputes only the dropped ones (zero
weights); above, it recomputes all. The op does so in float64 too when given the weights, which the tests use.
Gradients are checked against the float64 oracle (with dropout replayed from the Philox stream), for masks of every
kind; the op is checked to read the weights it is given (dV = W^T dO), to leave them unchanged, and to reject
weights of the wrong shape or dtype.
"""

import pytest
import torch

from conftest import TOLERANCES
from oracle import OracleBlock, oracle_attention
from philox_reference import expected_keep

OPS = torch.ops.fastmha
B, H, LQ, LK, D = 2, 3, 70, 90, 16


def masks():
    padding = torch.ones(B, 1, 1, LK, dtype=torch.bool)
    padding[-1, ..., 25:] = False
    rows_hidden = torch.rand(B, 1, LQ, LK) > 0.4
    rows_hidden[0, 0, 5:9] = False  # rows that see no key: uniform weights, no gradient
    return {"none": None, "padding": padding, "random with hidden rows": rows_hidden,
            "causal int": torch.ones(LQ, LK, dtype=torch.int32).tril()}


MASKS = masks()


def inputs(dtype):
    return [torch.randn(B, H, n, D, dtype=dtype) for n in (LQ, LK, LK)]


def oracle_gradients(q, k, v, mask, dropout_p, rng_state, is_causal, grad_out):
    keep = None
    if dropout_p > 0:
        seed, offset = (int(x) for x in rng_state)
        keep = expected_keep(seed & (2**64 - 1), offset, (B, H, LQ, LK), dropout_p)
    if is_causal:
        causal = torch.ones(LQ, LK, dtype=torch.bool).tril()
        mask = causal if mask is None else (mask != 0) & causal
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_inputs, mask, keep, dropout_p)
    return torch.autograd.grad(ref_out, ref_inputs, grad_out.double())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("dropout_p", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("key_block", ["", "32"])
def test_backward_from_kept_weights_matches_the_oracle(monkeypatch, dtype, mask_kind, dropout_p, is_causal, key_block):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", key_block)  # "32": many key blocks per chunk
    q, k, v = inputs(dtype)
    mask = MASKS[mask_kind]
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, dropout_p, True, is_causal)
    grad_out = torch.randn_like(out)
    kept = weights.clone()
    from_weights = OPS._attention_backward(grad_out, None, q, k, v, mask, out, lse, rng_state, dropout_p, is_causal,
                                           weights)
    recomputed = OPS._attention_backward(grad_out, None, q, k, v, mask, out, lse, rng_state, dropout_p, is_causal)
    want = oracle_gradients(q, k, v, mask, dropout_p, rng_state, is_causal, grad_out)
    for name, got, again, ref in zip("qkv", from_weights, recomputed, want):
        torch.testing.assert_close(got.double(), ref, **TOLERANCES[dtype], msg=lambda m: f"d{name}: {m}")
        torch.testing.assert_close(again.double(), ref, **TOLERANCES[dtype], msg=lambda m: f"d{name}: {m}")
    assert torch.equal(weights, kept), "the backward changed the weights it was given"


@pytest.mark.parametrize("dropout_p", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("mask_kind", ["none", "padding"])
@pytest.mark.parametrize("key_block", ["", "32"])
def test_backward_reads_the_weights_it_is_given(monkeypatch, dropout_p, mask_kind, key_block):
    # dV = W^T dO whatever W holds: other weights of the right shape give their own dV when the op reads them
    # (over the keys some query sees; with padding the rest carry no weight). With dropout up to 0.1 too: the
    # weights are the ones the forward applied, dropout included. Above, it recomputes them from the log-sum-exp
    # and the Philox stream instead.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", key_block)
    q, k, v = inputs(torch.float64)
    mask = MASKS[mask_kind]
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, dropout_p, True, False)
    grad_out = torch.randn_like(out)
    other = torch.rand_like(weights)
    if mask is not None:
        other = other * mask  # skipped keys are those no query of a chunk sees: they must weigh 0
    _, _, dv = OPS._attention_backward(grad_out, None, q, k, v, mask, out, lse, rng_state, dropout_p, False, other)
    read = other if dropout_p <= 0.1 else weights
    torch.testing.assert_close(dv, read.transpose(-2, -1) @ grad_out)


SPECIAL_INPUTS = {
    "NaN in a value row": lambda q, k, v, g: v[0, 1, 7].fill_(float("nan")),
    "infinity in a query row": lambda q, k, v, g: q[1, 2, 3].fill_(float("inf")),
    "zero output-gradient rows": lambda q, k, v, g: g[:, :, 10:40].zero_(),
    "infinity in an output-gradient row": lambda q, k, v, g: g[0, 1, 5, 2].fill_(float("inf")),
}


@pytest.mark.parametrize("special", list(SPECIAL_INPUTS))
@pytest.mark.parametrize("mask_kind", ["none", "padding", "random with hidden rows"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_backward_from_kept_weights_matches_recomputing_with_special_values(monkeypatch, special, mask_kind,
                                                                          is_causal, dropout_p):
    # NaN and infinity reach the same gradients (NaN where the math has NaN) as the recomputing backward, and
    # rows whose output gradient is zero take the same early way out.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    q, k, v = inputs(torch.float64)
    grad_out = torch.randn(B, H, LQ, D, dtype=torch.float64)
    SPECIAL_INPUTS[special](q, k, v, grad_out)
    mask = MASKS[mask_kind]
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, dropout_p, True, is_causal)
    args = (grad_out, None, q, k, v, mask, out, lse, rng_state, dropout_p, is_causal)
    for got, want in zip(OPS._attention_backward(*args, weights), OPS._attention_backward(*args)):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_backward_from_kept_weights_with_one_head_split_across_threads(monkeypatch):
    # One head of many query chunks: the backward splits them into ranges with partial dK and dV.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    q, k, v = (torch.randn(1, 1, n, D, dtype=torch.float64) for n in (600, 90, 90))
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, None, 0.0, True, False)
    grad_out = torch.randn_like(out)
    got = OPS._attention_backward(grad_out, None, q, k, v, None, out, lse, rng_state, 0.0, False, weights)
    ref_inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(oracle_attention(*ref_inputs)[0], ref_inputs, grad_out)
    for got_grad, want_grad in zip(got, want):
        torch.testing.assert_close(got_grad, want_grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_from_kept_weights_with_dropout_rows_near_the_fill(monkeypatch, dtype):
    # Visible scores about -1e9 + 50: the rows' softmax constants are computed exactly from all their scores (in
    # float32 such an lse is a multiple of 64), which one recomputed dot product would not match; with dropout
    # such rows recompute all their scores, and the result is the recomputing backward's.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    q = torch.zeros(B, H, LQ, D, dtype=dtype)
    q[..., 0] = 1.0
    k, v = torch.zeros(B, H, LK, D, dtype=dtype), torch.randn(B, H, LK, D, dtype=dtype)
    k[..., 0] = (-1e9 + 50 * torch.rand(B, H, LK, dtype=torch.float64)) * D**0.5
    mask = MASKS["padding"]
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, 0.1, True, False)
    grad_out = torch.randn_like(out)
    args = (grad_out, None, q, k, v, mask, out, lse, rng_state, 0.1, False)
    for got, want in zip(OPS._attention_backward(*args, weights), OPS._attention_backward(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_from_kept_weights_with_dropout_over_many_keys(monkeypatch, dtype):
    # Rows with more dropped weights in one key block than the kernel recomputes in one batch (64).
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", "2048")
    q, k, v = (torch.randn(1, 2, n, D, dtype=dtype) for n in (20, 1100, 1100))
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, None, 0.1, True, False)
    assert ((weights == 0).sum(-1) > 64).all()
    grad_out = torch.randn_like(out)
    got = OPS._attention_backward(grad_out, None, q, k, v, None, out, lse, rng_state, 0.1, False, weights)
    seed, offset = (int(x) for x in rng_state)
    keep = expected_keep(seed & (2**64 - 1), offset, tuple(weights.shape), 0.1)
    ref_inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(oracle_attention(*ref_inputs, None, keep, 0.1)[0], ref_inputs, grad_out)
    for name, got_grad, want_grad in zip("qkv", got, want):
        torch.testing.assert_close(got_grad, want_grad, **TOLERANCES[dtype], msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("d_k,d_v", [(8, 8), (40, 24), (72, 64)])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "random with hidden rows"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.1, 0.3])
def test_dropped_weights_recomputed_at_head_sizes_off_the_vector_width(monkeypatch, d_k, d_v, mask_kind, is_causal,
                                                                       dropout_p):
    # The dropped weights' scores are dot products of d_k elements, 16 keys at a time where AVX-512 runs: head sizes
    # below, between and above whole vectors, keys the mask hides among the dropped ones.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    q, k, v = (torch.randn(B, H, n, d, dtype=torch.float32) for n, d in ((LQ, d_k), (LK, d_k), (LK, d_v)))
    mask = MASKS[mask_kind]
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, dropout_p, True, is_causal)
    grad_out = torch.randn_like(out)
    got = OPS._attention_backward(grad_out, None, q, k, v, mask, out, lse, rng_state, dropout_p, is_causal, weights)
    want = oracle_gradients(q, k, v, mask, dropout_p, rng_state, is_causal, grad_out)
    for name, got_grad, want_grad in zip("qkv", got, want):
        torch.testing.assert_close(got_grad.double(), want_grad, **TOLERANCES[torch.float32],
                                   msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("module_dropout", [0.0, 0.1, 0.2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_drop_in_block_training_gradients_match_the_oracle(module_dropout, dtype):
    # Through autograd: the block keeps its weights and the loss reads only the output, so the backward gets them.
    import fastmha

    torch.manual_seed(3)
    d_model, heads, length = 32, 4, 40
    block = fastmha.MultiHeadAttentionBlock(d_model, heads, module_dropout).to(dtype).train()
    oracle = OracleBlock(d_model, heads, module_dropout).double()
    oracle.load_state_dict(block.state_dict())
    x = torch.randn(2, length, d_model, dtype=dtype, requires_grad=True)
    mask = torch.ones(2, 1, 1, length, dtype=torch.int64)
    mask[1, ..., 30:] = 0
    out = block(x, x, x, mask)
    weights = block.attention_scores.detach()
    grad_out = torch.randn_like(out)
    params = [block.w_q.weight, block.w_k.weight, block.w_v.weight, block.w_o.weight]
    got = torch.autograd.grad(out, [x] + params, grad_out)

    # The call's dropout mask: where its weights are 0 (no softmax weight of a visible key is, at these scores).
    xr = x.detach().double().requires_grad_()
    want_out, want_weights = oracle(xr, xr, xr, mask, weights != 0, module_dropout)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(weights.double(), want_weights, **tolerance)
    torch.testing.assert_close(out.double(), want_out, **tolerance)
    want = torch.autograd.grad(want_out, [xr, oracle.w_q.weight, oracle.w_k.weight, oracle.w_v.weight,
                                          oracle.w_o.weight], grad_out.double())
    for name, got_grad, want_grad in zip(["x", "w_q", "w_k", "w_v", "w_o"], got, want):
        torch.testing.assert_close(got_grad.double(), want_grad, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("bad,message", [
    (lambda w: w[..., :-1], r"weights must be the forward's kept weights of shape \(batch, h, Lq, Lk\)"),
    (lambda w: w.float(), "weights must have the query's dtype"),
    (lambda w: w[0], r"got shape \[3, 70, 90\]"),
])
def test_backward_rejects_weights_of_another_shape_or_dtype(bad, message):
    q, k, v = inputs(torch.float64)
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, None, 0.0, True, False)
    with pytest.raises(RuntimeError, match=message):
        OPS._attention_backward(torch.randn_like(out), None, q, k, v, None, out, lse, rng_state, 0.0, False,
                                bad(weights))


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_weights_changed_in_place_before_the_backward_raise(dropout_p):
    # The backward reads the very tensor the call returned: changing it in place first is an error, as for the
    # textbook block (its product with the values saves the weights too), not a silently wrong gradient.
    q, k, v = (t.requires_grad_() for t in inputs(torch.float32))
    out, weights = OPS.attention(q, k, v, None, dropout_p, True, False)
    weights.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_block_attention_scores_changed_in_place_before_the_backward_raise():
    import fastmha

    block = fastmha.MultiHeadAttentionBlock(32, 4, 0.0)
    x = torch.randn(2, 40, 32, requires_grad=True)
    out = block(x, x, x, None)
    block.attention_scores.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("case", ["dropout above 0.1", "float64 with dropout", "bfloat16", "torch's backward"])
def test_weights_are_not_saved_where_the_backward_would_not_read_them(monkeypatch, case):
    # Not saved, so changing them in place before the backward is no error: with dropout above 0.1 (too many
    # dropped weights to recompute one by one), with any dropout in float64 (recomputing them costs more there), in
    # a half type (too coarse to stand for the softmax), or when torch's kernel runs the backward.
    if case == "torch's backward":
        monkeypatch.setenv("FASTMHA_CPU_KERNELS", "stock")
    dtype = {"bfloat16": torch.bfloat16, "float64 with dropout": torch.float64}.get(case, torch.float32)
    dropout_p = {"dropout above 0.1": 0.2, "float64 with dropout": 0.1}.get(case, 0.0)
    q, k, v = (t.requires_grad_() for t in inputs(dtype))
    out, weights = OPS.attention(q, k, v, None, dropout_p, True, False)
    weights.mul_(2)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
