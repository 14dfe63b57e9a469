"""Gradients: gradcheck in float64 and comparisons with autograd through the oracle (also with dropout)."""

import pytest
import torch
from oracle import OracleBlock, oracle_attention
from torch.autograd import gradcheck

import fastmha


def leaf(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.float64, requires_grad=True)


MASKS = {
    "none": None,
    "padding": lambda d: torch.tensor([1, 1, 0, 1, 0], device=d, dtype=torch.bool)[None, None, None, :],
    "fully-masked-row": lambda d: torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], device=d),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_gradcheck_attention_core(device, mask_name):
    q, k, v = leaf(2, 2, 3, 4, device=device), leaf(2, 2, 5, 4, device=device), leaf(2, 2, 5, 3, device=device)
    mask = MASKS[mask_name](device) if MASKS[mask_name] else None

    def fn(q, k, v):
        out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True)
        return out, weights  # both outputs carry gradient

    assert gradcheck(fn, (q, k, v))


def test_gradcheck_attention_core_without_weights(device):
    q, k, v = leaf(1, 2, 4, 3, device=device), leaf(1, 2, 4, 3, device=device), leaf(1, 2, 4, 3, device=device)
    assert gradcheck(lambda q, k, v: torch.ops.fastmha.attention(q, k, v, None, 0.0, False)[0], (q, k, v))


@pytest.mark.parametrize("need_weights", [True, False])
def test_gradcheck_block_inputs_and_weights(device, need_weights):
    d_model, heads = 6, 2
    q, kv = leaf(2, 3, d_model, device=device), leaf(2, 4, d_model, device=device)
    weights = [leaf(d_model, d_model, device=device) for _ in range(4)]
    mask = torch.tensor([1, 0, 1, 1], device=device)[None, None, None, :]

    def fn(q, kv, w_q, w_k, w_v, w_o):
        out, attn = torch.ops.fastmha.multi_head_attention(q, kv, kv, w_q, w_k, w_v, w_o, heads, mask, 0.0,
                                                           need_weights)
        return (out, attn) if need_weights else out

    assert gradcheck(fn, (q, kv, *weights))


def test_block_gradients_match_oracle_with_dropout(device):
    p = 0.25
    block = fastmha.MultiHeadAttentionBlock(16, 4, p).to(device, torch.float64)
    oracle = OracleBlock(16, 4).to(device, torch.float64)
    oracle.load_state_dict(block.state_dict())
    x = torch.randn(3, 7, 16, device=device, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    mask = (torch.rand(3, 1, 7, 7, device=device) > 0.2)
    grad_out = torch.randn(3, 7, 16, device=device, dtype=torch.float64)

    out = block(x, x, x, mask)
    keep = block.attention_scores != 0  # the softmax is never exactly 0 here, so zeros are dropped positions
    (out * grad_out).sum().backward()
    ref_out, _ = oracle(x_ref, x_ref, x_ref, mask, keep=keep, p=p)
    (ref_out * grad_out).sum().backward()

    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        torch.testing.assert_close(getattr(block, name).weight.grad, getattr(oracle, name).weight.grad)


def test_gradient_through_stored_weights(device):
    # A loss on attention_scores (e.g. an attention regulariser) must reach the inputs too.
    block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0).to(device, torch.float64)
    oracle = OracleBlock(8, 2).to(device, torch.float64)
    oracle.load_state_dict(block.state_dict())
    x = torch.randn(2, 5, 8, device=device, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = block(x, x, x, None)
    (out.sum() + (block.attention_scores ** 2).sum()).backward()
    ref_out, ref_weights = oracle(x_ref, x_ref, x_ref)
    (ref_out.sum() + (ref_weights ** 2).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("used", ["output", "weights"])
@pytest.mark.parametrize("op", ["attention", "block"])
def test_loss_on_one_output_only(device, op, used):
    # The output that the loss never reads gets no gradient tensor at all (autograd passes none, not zeros).
    mask = torch.tensor([1, 1, 0, 1, 1, 0], device=device)[None, None, None, :]
    if op == "attention":
        inputs = [leaf(2, 3, 4, 5, device=device), leaf(2, 3, 6, 5, device=device), leaf(2, 3, 6, 5, device=device)]
        out, weights = torch.ops.fastmha.attention(*inputs, mask, 0.0, True)
        ref_out, ref_weights = oracle_attention(*inputs, mask)
    else:
        block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0).to(device, torch.float64)
        oracle = OracleBlock(8, 2).to(device, torch.float64)
        oracle.load_state_dict(block.state_dict())
        q, kv = leaf(2, 4, 8, device=device), leaf(2, 6, 8, device=device)
        inputs = [q, kv, *(getattr(block, n).weight for n in ("w_q", "w_k", "w_v", "w_o"))]
        out, weights = block(q, kv, kv, mask), block.attention_scores
        ref_inputs = [q, kv, *(getattr(oracle, n).weight for n in ("w_q", "w_k", "w_v", "w_o"))]
        ref_out, ref_weights = oracle(q, kv, kv, mask)
    loss, ref_loss = ((out ** 2).sum(), (ref_out ** 2).sum()) if used == "output" else (
        (weights ** 2).sum(), (ref_weights ** 2).sum())
    grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
    # The weights do not depend on the values (nor on w_v, w_o): the oracle's graph has no path there.
    ref_grads = torch.autograd.grad(ref_loss, inputs if op == "attention" else ref_inputs, allow_unused=True,
                                    materialize_grads=True)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("op", ["attention", "block"])
def test_a_loss_on_the_weights_alone_leaves_the_values_side_without_gradient(device, op):
    # The oracle's graph has no path from the weights to the value (nor to w_v, w_o): they get None, not zeros,
    # which an optimizer's weight decay and momentum would act on.
    if op == "attention":
        inputs = [leaf(2, 3, 4, 5, device=device) for _ in range(3)]
        torch.ops.fastmha.attention(*inputs, None, 0.0, True)[1].pow(2).sum().backward()
        oracle_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        oracle_attention(*oracle_inputs)[1].pow(2).sum().backward()
    else:
        block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0).to(device, torch.float64)
        oracle = OracleBlock(8, 2).to(device, torch.float64)
        oracle.load_state_dict(block.state_dict())
        q, k, v = (leaf(2, 4, 8, device=device) for _ in range(3))
        block(q, k, v, None)
        block.attention_scores.pow(2).sum().backward()
        inputs = [q, k, v] + [getattr(block, n).weight for n in ("w_q", "w_k", "w_v", "w_o")]
        oracle_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        oracle(*oracle_inputs)[1].pow(2).sum().backward()
        oracle_inputs += [getattr(oracle, n).weight for n in ("w_q", "w_k", "w_v", "w_o")]
    assert [t.grad is None for t in inputs] == [t.grad is None for t in oracle_inputs]
    assert inputs[2].grad is None
    for got, want in zip(inputs, oracle_inputs):
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad)


def test_fully_masked_row_gradient_matches_oracle(device):
    q, k, v = leaf(1, 1, 3, 4, device=device), leaf(1, 1, 5, 4, device=device), leaf(1, 1, 5, 4, device=device)
    mask = MASKS["fully-masked-row"](device)
    out, _ = torch.ops.fastmha.attention(q, k, v, mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(oracle_attention(q, k, v, mask)[0].sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fully_masked_row_gradient_in_float32(device, need_weights, is_causal):
    # In fp32 a fully masked row's log-sum-exp (-1e9 + log Lk) cannot be used to recompute its uniform
    # weights; the backward must still give the oracle's dV (found by the property tests).
    q, k, v = (torch.randn(2, 2, n, 8, device=device, requires_grad=True) for n in (5, 7, 7))
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool, device=device)
    mask[0, :, 1] = False
    mask[1, :, :, :2] = False  # with is_causal, rows 0 and 1 of batch 1 see only masked keys
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, need_weights, is_causal)
    effective = mask & torch.tril(torch.ones(5, 7, dtype=torch.bool, device=device)) if is_causal else mask
    ref_out, _ = oracle_attention(q.double(), k.double(), v.double(), effective)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(ref_out, (q, k, v), grad.double())
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-4, rtol=1e-4)
