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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_create_graph_gives_the_fused_backwards_gradients(device, dtype):
    # Every input and weight of the block, w_o's from the context of the replayed dropout's weights.
    x, m, *ws = ((torch.randn(*shape, device=device) / shape[-1] ** 0.5).to(dtype).requires_grad_()
                 for shape in ((2, 5, 16), (2, 7, 16), (16, 16), (16, 16), (16, 16), (16, 16)))
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool, device=device)
    mask[1, ..., 4:] = False
    out, weights = torch.ops.fastmha.multi_head_attention(x, m, m, *ws, 2, mask, 0.4, True)
    grads = (torch.randn_like(out), torch.randn_like(weights))
    fused = torch.autograd.grad((out, weights), (x, m, *ws), grads, retain_graph=True)
    with_graph = torch.autograd.grad((out, weights), (x, m, *ws), grads, create_graph=True)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip(fused, with_graph):
        assert b.requires_grad
        torch.testing.assert_close(b.detach(), a, atol=tol, rtol=tol)


@pytest.mark.parametrize("padding", ["light", "heavy"])
@pytest.mark.parametrize("path", ["fused", "module path", "scripted"])
def test_gradient_penalty_matches_the_oracle_block(device, path, padding):
    # Heavy padding: keys that no query sees are not projected by the fused forward (zeros stand in for them, which
    # the second-order graph reuses).
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
    if padding == "heavy":
        mask[0, ..., 2:] = 0
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


FIRST_LOSSES = {
    "linear in the output": lambda out, weights, c: (out * c).sum(),
    "weights and linear output": lambda out, weights, c: weights.square().sum() + (out * c).sum(),
    "weights and squared output": lambda out, weights, c: weights.square().sum() + out.square().sum(),
    "weights only": lambda out, weights, c: weights.square().sum(),
    "squared output": lambda out, weights, c: out.square().sum(),
}


@pytest.mark.parametrize("loss, need_weights", [(loss, True) for loss in FIRST_LOSSES] +
                         [("linear in the output", False), ("squared output", False)])
def test_second_and_third_order_through_each_output_match_the_oracle(device, loss, need_weights):
    # The second differentiation reaches the block's node through the projections its first-order gradients were
    # built on, and through its output and kept weights where the first loss was not linear in them: each
    # combination against the oracle block, gradients of every input and weight (None where the oracle's are).
    # A third differentiation goes through the graph the second one built.
    torch.manual_seed(0)
    oracle = OracleBlock(8, 2).double().to(device)
    x, key, value = (torch.randn(2, n, 8, device=device, dtype=torch.float64) for n in (4, 5, 5))
    mask = torch.tensor([1, 1, 1, 0, 1], device=device)[None, None, None, :]
    scale = torch.randn(2, 4, 8, device=device, dtype=torch.float64)
    names = ["w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"]

    def fused(x, key, value, *ws):
        return torch.ops.fastmha.multi_head_attention(x, key, value, *ws, 2, mask, 0.0, need_weights)

    def formulas(x, key, value, *ws):
        return torch.func.functional_call(oracle, dict(zip(names, ws)), (x, key, value, mask))

    def squares(grads):
        return sum(g.square().sum() for g in grads if g is not None)

    results = []
    for block in (fused, formulas):
        leaves = [t.detach().clone().requires_grad_()
                  for t in (x, key, value, *(oracle.get_parameter(n) for n in names))]
        out, weights = block(*leaves)
        first = torch.autograd.grad(FIRST_LOSSES[loss](out, weights, scale), leaves, create_graph=True,
                                    allow_unused=True)
        second = torch.autograd.grad(squares(first), leaves, create_graph=True, allow_unused=True)
        third = torch.autograd.grad(squares(second), leaves, allow_unused=True)
        results.append(second + third)
    for got, expected in zip(*results):
        assert (got is None) == (expected is None)
        if expected is not None:
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


@pytest.mark.parametrize("op", ["attention", "block"])
def test_create_graph_under_compiled_autograd(op):
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    x = torch.randn(1, 4, 8, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(8, 8, dtype=torch.float64, requires_grad=True) for _ in range(4)]

    def penalty():
        # First order with create_graph, then second order: the graph's own nodes run under compiled autograd too.
        if op == "attention":
            out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, True)
            first = torch.autograd.grad(out.square().sum(), q, create_graph=True)
            leaves = [q, k, v]
        else:
            out, _ = torch.ops.fastmha.multi_head_attention(x, x, x, *ws, 2, None, 0.0, True)
            first = torch.autograd.grad(out.square().sum(), [x, ws[0]], create_graph=True)
            leaves = [x, *ws]
        second = torch.autograd.grad(sum(g.square().sum() for g in first), leaves)
        return [g.detach() for g in first], second

    expected = penalty()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        got = torch.compile(penalty, backend="eager")()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("lengths", [(5, 6), (181, 183)], ids=["short", "split among threads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_multipliers_are_the_forwards(device, dtype, lengths):
    # The longer one has more elements than one thread's share, in parts that do not start on a Philox block.
    q, k, v = (torch.randn(2, 3, n, 4, device=device, dtype=dtype) for n in (lengths[0], lengths[1], lengths[1]))
    p = 0.35
    _, weights, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, None, p, True, False)
    multipliers = torch.ops.fastmha._dropout_multipliers(list(weights.shape), p, dtype, rng_state)
    probs = torch.softmax(q @ k.transpose(-2, -1) / 2.0, dim=-1)  # d_k = 4
    values = multipliers.unique().tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / (1 - p))
    torch.testing.assert_close(weights, probs * multipliers)
    torch.library.opcheck(torch.ops.fastmha._dropout_multipliers.default, (list(weights.shape), p, dtype, rng_state))


def test_dropout_multipliers_do_not_depend_on_the_thread_count():
    # Threads split the elements into parts that may start inside a Philox block (four elements each): every part
    # and every length draws the elements of one stream.
    rng_state = torch.tensor([1234, 5678])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        longest = torch.ops.fastmha._dropout_multipliers([200_003], 0.3, torch.float32, rng_state)
        for count in (2, 3, 5, 7):
            torch.set_num_threads(count)
            for n in (0, 1, 3, 16_385, 99_999, 200_003):
                got = torch.ops.fastmha._dropout_multipliers([n], 0.3, torch.float32, rng_state)
                assert torch.equal(got, longest[:n]), (count, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("op", ["attention", "block"])
def test_a_weights_only_loss_leaves_the_value_side_without_gradient(op):
    # As in the first-order backward (and the textbook block): no output gradient, so nothing reaches the value,
    # w_v or w_o, not even zeros, at second order either.
    x, m, *ws = leaves("cpu", (1, 3, 4), (1, 3, 4), (4, 4), (4, 4), (4, 4), (4, 4))
    if op == "attention":
        heads = [t.detach().view(1, 1, 3, 4).requires_grad_() for t in (x, m, m)]
        _, weights = torch.ops.fastmha.attention(*heads)
        first, untouched = heads[0], [heads[2]]
    else:
        _, weights = torch.ops.fastmha.multi_head_attention(x, m, m.detach().clone().requires_grad_(), *ws, 2)
        first, untouched = x, [ws[2], ws[3]]
    (grad,) = torch.autograd.grad(weights.square().sum(), first, create_graph=True)
    grad.square().sum().backward()
    assert all(t.grad is None for t in untouched)


@pytest.mark.parametrize("op", ["attention", "block"])
def test_batched_create_graph_gradients_of_the_weights(op):
    # is_grads_batched vmaps the backward over a batch of weight gradients (a Jacobian); with create_graph too.
    q, k, v = leaves("cpu", (1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    ws = leaves("cpu", (4, 4), (4, 4), (4, 4), (4, 4))

    def weights_of(q):
        if op == "attention":
            return torch.ops.fastmha.attention(q, k, v)[1]
        return torch.ops.fastmha.multi_head_attention(q[0], k[0], v[0], *ws, 2)[1]

    weights = weights_of(q)
    basis = torch.eye(weights.numel(), dtype=torch.float64).view(-1, *weights.shape)
    plain = torch.autograd.grad(weights, q, basis, is_grads_batched=True, retain_graph=True)[0]
    with_graph = torch.autograd.grad(weights, q, basis, is_grads_batched=True, create_graph=True)[0]
    torch.testing.assert_close(with_graph, plain)


BAD_MULTIPLIER_ARGS = {
    "empty rng_state": (dict(rng_state=torch.empty(0, dtype=torch.long)), r"rng_state must be the int64 \(seed, offset\) pair"),
    "short rng_state": (dict(rng_state=torch.tensor([1])), r"got Long of shape \[1\]"),
    "float rng_state": (dict(rng_state=torch.zeros(2)), r"rng_state must be .* got Float"),
    "negative p": (dict(p=-0.5), r"dropout_p must be in \[0, 1\), got -0.5"),
    "p of 1": (dict(p=1.0), r"dropout_p must be in \[0, 1\), got 1"),
    "half dtype": (dict(dtype=torch.bfloat16), r"dtype must be float32 or float64 .* got BFloat16"),
}


@pytest.mark.parametrize("device_name", ["cpu", "meta"])
@pytest.mark.parametrize("case", BAD_MULTIPLIER_ARGS)
def test_bad_dropout_multiplier_arguments_are_named(case, device_name):
    changes, message = BAD_MULTIPLIER_ARGS[case]
    args = dict(p=0.5, dtype=torch.float32, rng_state=torch.tensor([3, 0]))
    args.update(changes)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fastmha._dropout_multipliers([2, 3], args["p"], args["dtype"], args["rng_state"].to(device_name))
