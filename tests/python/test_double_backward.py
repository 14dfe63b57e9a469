"""Double backward (create_graph=True, then a gradient of the gradients: gradient penalties, Hessian-vector
products): gradgradcheck in float64 for the ops, and the gradient penalty of the block against the oracle block's."""

import pytest
import torch
from oracle import OracleBlock
from torch.autograd import gradgradcheck

import fastmha

MASK_CASES = {
    "none": None,
    "padding": lambda d: torch.tensor([1, 1, 0, 1, 1, 0], device=d)[None, None, None, :],
    "fully masked row": lambda d: torch.tensor([[1, 0, 1, 1, 1, 1], [0] * 6, [1, 1, 1, 0, 1, 1]], device=d).bool(),
}


def leaves(device, *shapes):
    return [torch.randn(*shape, device=device, dtype=torch.float64, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("mask_name", list(MASK_CASES))
def test_gradgradcheck_attention_core(device, mask_name, is_causal, need_weights):
    q, k, v = leaves(device, (1, 2, 3, 4), (1, 2, 6, 4), (1, 2, 6, 3))
    mask = MASK_CASES[mask_name](device) if MASK_CASES[mask_name] else None

    def fn(q, k, v):
        out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, need_weights, is_causal)
        return (out, weights) if need_weights else out

    assert gradgradcheck(fn, (q, k, v))


def test_gradgradcheck_attention_core_with_dropout(device):
    q, k, v = leaves(device, (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3))

    def fn(q, k, v):
        torch.manual_seed(7)  # one dropout draw for every call gradgradcheck makes
        return torch.ops.fastmha.attention(q, k, v, None, 0.3, True)

    assert gradgradcheck(fn, (q, k, v))


def test_gradgradcheck_self_attention_one_tensor(device):
    # One tensor as query, key and value: each argument's part of the gradient, summed once by autograd.
    (x,) = leaves(device, (1, 2, 4, 3))
    assert gradgradcheck(lambda x: torch.ops.fastmha.attention(x, x, x, None, 0.0, True), (x,))


@pytest.mark.parametrize("need_weights", [True, False])
def test_gradgradcheck_block(device, need_weights):
    x, m, *ws = leaves(device, (2, 3, 4), (2, 5, 4), (4, 4), (4, 4), (4, 4), (4, 4))
    mask = torch.tensor([1, 1, 0, 1, 0], device=device)[None, None, None, :]

    def fn(x, m, *ws):
        torch.manual_seed(3)
        out, weights = torch.ops.fastmha.multi_head_attention(x, m, m, *ws, 2, mask, 0.2, need_weights)
        return (out, weights) if need_weights else out

    assert gradgradcheck(fn, (x, m, *ws))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("asked", ["all", "key only", "weights only"])
def test_create_graph_gives_the_fused_backwards_gradients(device, dtype, asked):
    # The gradients built for a second differentiation are the ones the fused backward gives, dropout included
    # (the forward's draw is replayed), and None where the fused backward gives None.
    q, k, v = (torch.randn(2, 2, n, 8, device=device, dtype=dtype) for n in (5, 7, 7))
    for t in (q, k, v) if asked != "key only" else (k,):
        t.requires_grad_()
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool, device=device)
    mask[0, :, 1] = False
    mask[1, ..., 5:] = False
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.4, True)
    outputs = (weights,) if asked == "weights only" else (out, weights)
    grads = tuple(torch.randn_like(t) for t in outputs)
    inputs = tuple(t for t in (q, k, v) if t.requires_grad)
    fused = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    with_graph = torch.autograd.grad(outputs, inputs, grads, create_graph=True, allow_unused=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(fused, with_graph):
        assert (a is None) == (b is None)
        if a is not None:
            assert b.requires_grad  # a graph to differentiate again
            torch.testing.assert_close(b.detach(), a, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["fused", "module path", "scripted"])
def test_gradient_penalty_matches_the_oracle_block(device, path):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(16, 2, 0.0).double().to(device)
    oracle = OracleBlock(16, 2).double().to(device)
    oracle.load_state_dict(block.state_dict())
    if path == "module path":
        block.w_k.register_forward_hook(lambda module, args, output: None)
    module = torch.jit.script(block) if path == "scripted" else block
    x = torch.randn(2, 5, 16, device=device, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.int64, device=device)
    mask[1, ..., 3:] = 0
    results = []
    for m in (module, oracle):
        inputs = x.clone().requires_grad_()
        out = m(inputs, inputs, inputs, mask)
        out = out if isinstance(out, torch.Tensor) else out[0]
        (grad,) = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
        grad.square().sum().backward()  # the penalty's gradient reaches the input and every weight
        results.append([inputs.grad] + [p.grad for p in m.parameters()])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)


def test_hessian_vector_product_of_a_decoding_step(device):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0).double().to(device)
    oracle = OracleBlock(8, 2).double().to(device)
    oracle.load_state_dict(block.state_dict())
    x = torch.randn(1, 3, 8, device=device, dtype=torch.float64)
    causal = torch.tril(torch.ones(3, 3, device=device))
    direction = torch.randn_like(x)
    products = []
    for step in (lambda t: block.forward_step(t)[0], lambda t: oracle(t, t, t, causal)[0]):
        _, hvp = torch.autograd.functional.hvp(lambda t: step(t).sin().sum(), x, direction)
        products.append(hvp)
    torch.testing.assert_close(products[0], products[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_create_graph_inside_autocast(dtype):
    # The gradients' ATen ops run in the kernels' dtypes (scores and softmax in float32), not the autocast dtype,
    # whose -1e9 fill would overflow float16.
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.tensor([1, 1, 0, 1])[None, None, None, :]
    with torch.autocast("cpu", dtype=dtype):
        out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, True)
        fused = torch.autograd.grad(out.float().sum(), (q, k, v), retain_graph=True)
        with_graph = torch.autograd.grad(out.float().sum(), (q, k, v), create_graph=True)
    tol = 2e-3 if dtype == torch.float16 else 1e-2  # the op's gradients are rounded to the autocast dtype
    for a, b in zip(fused, with_graph):
        torch.testing.assert_close(b.detach(), a, atol=tol, rtol=tol)


def test_a_traced_penalty_replays_the_dropout_draw():
    # The forward's dropout multipliers are an op of their own in the gradients' graph, so a tracer records them.
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))

    def penalty(q, k, v):
        out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.3, False)
        (grad,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return grad.square().sum()

    torch.manual_seed(1)
    traced = make_fx(penalty, tracing_mode="real")(q, k, v)
    assert any("fastmha._dropout_multipliers" in str(node.target) for node in traced.graph.nodes)
    torch.manual_seed(1)
    expected = penalty(q, k, v)
    torch.manual_seed(1)
    torch.testing.assert_close(traced(q, k, v), expected)


def test_create_graph_under_compiled_autograd():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))

    def first_order():
        out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, True)
        return torch.autograd.grad(out.square().sum(), q, create_graph=True)[0]

    expected = first_order()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        got = torch.compile(first_order, backend="eager")()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_multipliers_are_the_forwards(device, dtype):
    q, k, v = (torch.randn(2, 3, n, 4, device=device, dtype=dtype) for n in (5, 6, 6))
    p = 0.35
    _, weights, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, None, p, True, False)
    multipliers = torch.ops.fastmha._dropout_multipliers(list(weights.shape), p, dtype, rng_state)
    probs = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)  # d_k = 4
    values = multipliers.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / (1 - p))
    torch.testing.assert_close(weights, probs * multipliers)
    torch.library.opcheck(torch.ops.fastmha._dropout_multipliers.default, (list(weights.shape), p, dtype, rng_state))
