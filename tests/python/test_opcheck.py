"""torch.library.opcheck on every fastmha op: schema, autograd registration, fake/meta kernels, AOT dispatch.

Dropout is 0 here (opcheck compares repeated runs); dropout is tested on its own elsewhere.
"""

import pytest
import torch

import fastmha  # noqa: F401

OPS = torch.ops.fastmha


def make_mask(kind, device):
    """Masks for queries of length 5 over keys of length 6: none, a bool padding mask, a float 2-D mask."""
    return {"none": None,
            "bool": torch.rand(2, 1, 1, 6, device=device) > 0.3,
            "float-2d": (torch.rand(5, 6, device=device) > 0.3).double()}[kind]


def core_args(device, requires_grad, mask_kind):
    q, k, v = (torch.randn(2, 3, n, 4, device=device, dtype=torch.float64, requires_grad=requires_grad)
               for n in (5, 6, 6))
    mask = make_mask(mask_kind, device)
    return q, k, v, mask


def block_args(device, requires_grad, mask_kind):
    x = torch.randn(2, 5, 8, device=device, dtype=torch.float64, requires_grad=requires_grad)
    kv = torch.randn(2, 6, 8, device=device, dtype=torch.float64, requires_grad=requires_grad)
    ws = [torch.randn(8, 8, device=device, dtype=torch.float64, requires_grad=requires_grad) for _ in range(4)]
    mask = make_mask(mask_kind, device)
    return x, kv, ws, mask


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float-2d"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_attention(device, requires_grad, mask_kind, need_weights, is_causal):
    q, k, v, mask = core_args(device, requires_grad, mask_kind)
    torch.library.opcheck(OPS.attention.default, (q, k, v, mask, 0.0, need_weights, is_causal))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float-2d"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_multi_head_attention(device, requires_grad, mask_kind, need_weights, is_causal):
    x, kv, ws, mask = block_args(device, requires_grad, mask_kind)
    torch.library.opcheck(OPS.multi_head_attention.default,
                          (x, kv, kv, *ws, 2, mask, 0.0, need_weights, is_causal))


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_internal_attention_ops(device, mask_kind, is_causal):
    q, k, v, mask = core_args(device, False, mask_kind)
    torch.library.opcheck(OPS._attention_forward.default, (q, k, v, mask, 0.0, True, is_causal))
    out, _, lse, rng_state = OPS._attention_forward(q, k, v, mask, 0.0, False, is_causal)
    grad_out = torch.randn_like(out)
    grad_weights = torch.randn(2, 3, 5, 6, device=device, dtype=torch.float64)
    torch.library.opcheck(OPS._attention_backward.default,
                          (grad_out, grad_weights, q, k, v, mask, out, lse, rng_state, 0.0, is_causal))
    torch.library.opcheck(OPS._attention_backward.default, (grad_out, None, q, k, v, mask, out, lse, rng_state, 0.0, is_causal))
    # With the weights the forward kept, which the CPU backward reads instead of recomputing them.
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, 0.0, True, is_causal)
    torch.library.opcheck(OPS._attention_backward.default,
                          (grad_out, None, q, k, v, mask, out, lse, rng_state, 0.0, is_causal, weights))


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_internal_block_ops(device, mask_kind, is_causal):
    x, kv, ws, mask = block_args(device, False, mask_kind)
    torch.library.opcheck(OPS._multi_head_attention_forward.default, (x, kv, kv, *ws, 2, mask, 0.0, True, is_causal))
    out, weights, qp, kp, vp, ctx, lse, rng_state = OPS._multi_head_attention_forward(x, kv, kv, *ws, 2, mask,
                                                                                        0.0, True, is_causal)
    torch.library.opcheck(
        OPS._multi_head_attention_backward.default,
        (torch.randn_like(out), torch.randn_like(weights), x, kv, kv, *ws, qp, kp, vp, ctx, lse, rng_state, 2, mask,
         0.0, is_causal))
    torch.library.opcheck(
        OPS._multi_head_attention_backward.default,
        (torch.randn_like(out), None, x, kv, kv, *ws, qp, kp, vp, ctx, lse, rng_state, 2, mask, 0.0, is_causal, weights))
    # With gradients that reached the projections by another path (a second-order graph built on them).
    torch.library.opcheck(
        OPS._multi_head_attention_backward.default,
        (torch.randn_like(out), None, x, kv, kv, *ws, qp, kp, vp, ctx, lse, rng_state, 2, mask, 0.0, is_causal, None,
         torch.randn_like(qp), None, torch.randn_like(vp)))
    # Key and value one tensor (shared_inputs 4): their gradients summed into the key's, the value's empty.
    torch.library.opcheck(
        OPS._multi_head_attention_backward.default,
        (torch.randn_like(out), None, x, kv, kv, *ws, qp, kp, vp, ctx, lse, rng_state, 2, mask, 0.0, is_causal, None,
         None, None, None, 4))


@pytest.mark.parametrize("with_cache", [False, True])
def test_opcheck_multi_head_attention_step(device, with_cache):
    x = torch.randn(2, 3, 8, device=device, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(8, 8, device=device, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    cache = [torch.randn(2, 2, 5, 4, device=device, dtype=torch.float64) for _ in range(2)] if with_cache else [None, None]
    torch.library.opcheck(OPS.multi_head_attention_step.default, (x, *ws, 2, *cache, None, 0.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck_projection(device, dtype):
    """The block's own x W^T, which its reuse of kept projections calls (from 512 rows on oneDNN where the switch
    says so)."""
    for rows in (3, 600):
        x = torch.randn(2, rows, 8, device=device, dtype=dtype)
        torch.library.opcheck(OPS._projection.default, (x, torch.randn(6, 8, device=device, dtype=dtype)))


def test_projection_op_has_no_derivative():
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="derivative for fastmha::_projection is not implemented"):
        OPS._projection(x, w).sum().backward()
