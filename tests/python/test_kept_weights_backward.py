"""The CPU backward takes P from the weights a call without dropout kept, instead of recomputing the scores.

When a float32 or float64 call without dropout keeps its weights (need_weights=True, the drop-in's case) and the
loss does not read them, autograd hands them to the backward op. Gradients are checked against the float64 oracle
(with dropout replayed from the Philox stream, where the op recomputes whatever weights it is given), for masks of
every kind; the op is checked to read the weights it is given without dropout (dV = W^T dO), to leave them
unchanged, and to reject weights of the wrong shape or dtype.
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
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
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


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_backward_reads_the_weights_it_is_given_without_dropout(monkeypatch, dropout_p):
    # dV = W^T dO whatever W holds: other weights of the right shape give their own dV when the op reads them.
    # With dropout it recomputes the weights from the log-sum-exp and the Philox stream instead.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    q, k, v = inputs(torch.float64)
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, None, dropout_p, True, False)
    grad_out = torch.randn_like(out)
    other = torch.rand_like(weights)
    _, _, dv = OPS._attention_backward(grad_out, None, q, k, v, None, out, lse, rng_state, dropout_p, False, other)
    torch.testing.assert_close(dv, (other if dropout_p == 0 else weights).transpose(-2, -1) @ grad_out)


@pytest.mark.parametrize("module_dropout", [0.0, 0.2])
def test_drop_in_block_training_gradients_match_the_oracle(module_dropout):
    # Through autograd: the block keeps its weights and the loss reads only the output, so the backward gets them.
    import fastmha

    torch.manual_seed(3)
    d_model, heads, length = 32, 4, 40
    block = fastmha.MultiHeadAttentionBlock(d_model, heads, module_dropout).double().train()
    oracle = OracleBlock(d_model, heads, module_dropout).double()
    oracle.load_state_dict(block.state_dict())
    x = torch.randn(2, length, d_model, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 1, length, dtype=torch.int64)
    mask[1, ..., 30:] = 0
    out = block(x, x, x, mask)
    weights = block.attention_scores.detach()
    grad_out = torch.randn_like(out)
    params = [block.w_q.weight, block.w_k.weight, block.w_v.weight, block.w_o.weight]
    got = torch.autograd.grad(out, [x] + params, grad_out)

    # The call's dropout mask: where its weights are 0 (in float64 no softmax weight of a visible key is).
    xr = x.detach().requires_grad_()
    want_out, want_weights = oracle(xr, xr, xr, mask, weights != 0, module_dropout)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(out, want_out)
    want = torch.autograd.grad(want_out, [xr, oracle.w_q.weight, oracle.w_k.weight, oracle.w_v.weight,
                                          oracle.w_o.weight], grad_out)
    for name, got_grad, want_grad in zip(["x", "w_q", "w_k", "w_v", "w_o"], got, want):
        torch.testing.assert_close(got_grad, want_grad, msg=lambda m: f"{name}: {m}")


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
