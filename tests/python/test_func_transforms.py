"""torch.func transforms (grad, vmap of grad for per-sample gradients, jvp) over the block and its static attention,
against the oracle block under the same transforms: the ops' C++ autograd is opaque to them, so the block computes
with torch's own ops there. Also projections that are called although they look plain: a forward set on the
instance or patched onto the class, and a weight that is a tensor subclass."""

import pytest
import torch
from conftest import OpCounter, assert_close
from oracle import OracleBlock, oracle_attention
from torch import nn
from torch.func import functional_call, grad, jvp, vmap
from torch.utils._pytree import tree_map

import fastmha

D_MODEL, HEADS = 16, 4


def pair(**kwargs):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.0, **kwargs).double()
    oracle = OracleBlock(D_MODEL, HEADS).double()
    oracle.load_state_dict(block.state_dict())
    return block, oracle


def batch():
    x = torch.randn(3, 5, D_MODEL, dtype=torch.float64)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.int64)
    mask[1, ..., 3:] = 0
    mask[2, ..., :] = 0  # a row with no visible key: uniform weights
    return x, mask


def per_sample_loss(model):
    def loss(params, x, mask):
        out = functional_call(model, params, (x[None], x[None], x[None], mask[None]))
        return (out[0] if isinstance(out, tuple) else out).pow(2).sum()
    return loss


def assert_dicts_close(got, want):
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name])


@pytest.mark.parametrize("is_causal", [False, True])
def test_grad_and_per_sample_grads_match_the_oracle(is_causal):
    block, oracle = pair(is_causal=is_causal)
    x, mask = batch()
    if is_causal:  # the oracle gets the causal cut in its mask
        mask = mask * torch.ones(5, 5, dtype=torch.int64).tril()
    params = {name: p.detach() for name, p in block.named_parameters()}
    got = grad(per_sample_loss(block))(params, x[0], mask[0])
    want = grad(per_sample_loss(oracle))(params, x[0], mask[0])
    assert_dicts_close(got, want)
    got = vmap(grad(per_sample_loss(block)), in_dims=(None, 0, 0))(params, x, mask)
    want = vmap(grad(per_sample_loss(oracle)), in_dims=(None, 0, 0))(params, x, mask)
    assert_dicts_close(got, want)


def test_jvp_matches_the_oracle():
    block, oracle = pair()
    x, mask = batch()
    tangent = torch.randn_like(x)
    out, derivative = jvp(lambda z: block(z, z, z, mask), (x,), (tangent,))
    want, want_derivative = jvp(lambda z: oracle(z, z, z, mask)[0], (x,), (tangent,))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(derivative, want_derivative)


def test_forward_mode_ad_matches_the_oracle():
    # Dual tensors (torch.autograd.forward_ad) reach the ops, whose C++ autograd has no forward derivative: a call
    # with a tangent computes with the ATen implementation's ops. The block (eager and scripted), its
    # forward_step and its static attention against the oracle; tangents of the input and of a weight.
    import torch.autograd.forward_ad as fwAD

    block, oracle = pair()
    x, mask = batch()
    tangent, weight_tangent = torch.randn_like(x), torch.randn_like(block.w_k.weight)
    causal = torch.ones(5, 5, dtype=torch.int64).tril()

    def dual_run(model, mask):
        params = {n: p.detach() for n, p in model.named_parameters()}
        with fwAD.dual_level():
            params["w_k.weight"] = fwAD.make_dual(params["w_k.weight"], weight_tangent)
            z = fwAD.make_dual(x, tangent)
            out = functional_call(model, params, (z, z, z, mask))
            return fwAD.unpack_dual(out if isinstance(out, torch.Tensor) else out[0])

    for m in (mask, causal):
        got, want = dual_run(block, m), dual_run(oracle, m)
        torch.testing.assert_close(got.primal, want.primal)
        torch.testing.assert_close(got.tangent, want.tangent)
    # Cross-attention under no_grad, after a plain call (which keeps the key and value projections for reuse), and
    # a float mask with a tangent of its own (the mask's values only select: no contribution).
    memory = torch.randn(3, 5, D_MODEL, dtype=torch.float64)
    float_mask = mask.double()
    with torch.no_grad():
        block(x, memory, memory, mask)
        with fwAD.dual_level():
            z = fwAD.make_dual(x, tangent)
            dual_mask = fwAD.make_dual(float_mask, torch.randn_like(float_mask))
            got = fwAD.unpack_dual(block(z, memory, memory, dual_mask)).tangent
            want = fwAD.unpack_dual(oracle(z, memory, memory, mask)[0]).tangent
    assert got is not None
    torch.testing.assert_close(got, want)
    # The outputs of a call with tangents take a reverse-mode backward as well.
    grads = []
    for model in (block, oracle):
        z = x.clone().requires_grad_()
        with fwAD.dual_level():
            out = model(fwAD.make_dual(z, tangent), z, z, mask)
            (out if isinstance(out, torch.Tensor) else out[0]).square().sum().backward()
        grads.append([z.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    scripted = torch.jit.script(block)
    with fwAD.dual_level():
        z = fwAD.make_dual(x, tangent)
        want = fwAD.unpack_dual(oracle(z, z, z, mask)[0]).tangent
        torch.testing.assert_close(fwAD.unpack_dual(scripted(z, z, z, mask)).tangent, want)
        z = fwAD.make_dual(x[:, :1], tangent[:, :1])
        step, _ = block.forward_step(z)
        torch.testing.assert_close(fwAD.unpack_dual(step).tangent, fwAD.unpack_dual(block(z, z, z)).tangent)
        heads = [fwAD.make_dual(t, torch.randn_like(t)) for t in torch.randn(3, 2, 4, 3, 8, dtype=torch.float64)]
        got = fastmha.MultiHeadAttentionBlock.attention(*heads, mask=None, dropout=None)
        for a, b in zip(got, oracle_attention(*heads)):
            torch.testing.assert_close(fwAD.unpack_dual(a).tangent, fwAD.unpack_dual(b).tangent)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_jvp_and_jacfwd_of_the_ops_match_the_formulas(dtype):
    # torch.func's forward-mode transforms over the ops themselves: output and weights tangents, masks and causal.
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.float64) for n in (3, 5, 5))
    tangents = [torch.randn_like(t) for t in (q, k, v)]
    mask = torch.tensor([1, 1, 0, 1, 0])[None, None, None, :]
    causal = torch.ones(3, 5).tril()

    def op(q, k, v, is_causal):
        return torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, is_causal)

    for is_causal in (False, True):
        primals = [t.to(dtype) for t in (q, k, v)]
        got = jvp(lambda *a: op(*a, is_causal), tuple(primals), tuple(t.to(dtype) for t in tangents))
        want = jvp(lambda *a: oracle_attention(*a, mask * causal if is_causal else mask), (q, k, v), tuple(tangents))
        for a, b in zip(got[1], want[1]):  # tangents of the output and the weights
            assert a.dtype == dtype
            assert_close(a, b, dtype)
    got = torch.func.jacfwd(lambda q: op(q, k, v, False)[0])(q)
    torch.testing.assert_close(got, torch.func.jacfwd(lambda q: oracle_attention(q, k, v, mask)[0])(q))
    # A tangent on a float mask alone: the mask only selects keys, so the outputs' tangents are zero.
    float_mask = mask.double()
    x, memory = torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    ws = [torch.randn(16, 16, dtype=torch.float64) for _ in range(4)]
    for call in (lambda m: torch.ops.fastmha.attention(q, k, v, m, 0.0, True),
                 lambda m: torch.ops.fastmha.multi_head_attention(x, memory, memory, *ws, 2, m, 0.0, True)):
        _, mask_tangents = jvp(call, (float_mask,), (torch.randn_like(float_mask),))
        assert all(torch.count_nonzero(t) == 0 for t in mask_tangents)
    # Without kept weights: the output's tangent, and an empty weights tensor.
    out, tangent = jvp(lambda q: torch.ops.fastmha.attention(q, k, v, mask, 0.0, False), (q,), (tangents[0],))
    assert out[1].numel() == 0 and tangent[1].numel() == 0
    torch.testing.assert_close(tangent[0], jvp(lambda q: oracle_attention(q, k, v, mask)[0], (q,), (tangents[0],))[1])


def test_forward_mode_ad_draws_the_ops_dropout():
    # With a tangent the ops draw the same dropout stream as without: under one seed the same output.
    import torch.autograd.forward_ad as fwAD

    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    ws = [torch.randn(16, 16, dtype=torch.float64) / 4 for _ in range(4)]
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    calls = [lambda z: torch.ops.fastmha.attention(z, k, v, None, 0.4, True),
             lambda z: torch.ops.fastmha.multi_head_attention(x, z.transpose(1, 2).reshape(2, 6, 16), x, *ws, 2,
                                                               None, 0.4, True)]  # z's heads merged: the key
    tangent = torch.randn_like(q)
    for call in calls:
        torch.manual_seed(3)
        plain = call(q)
        with fwAD.dual_level():
            torch.manual_seed(3)
            dual = call(fwAD.make_dual(q, tangent))
            for a, b in zip(dual, plain):
                torch.testing.assert_close(fwAD.unpack_dual(a).primal, b)
                assert fwAD.unpack_dual(a).tangent is not None
        assert (plain[1] == 0).any()  # some weights were dropped
    # The core's tangent is the formulas' with that dropout mask (read off the kept weights: none underflows).
    torch.manual_seed(3)
    kept = (calls[0](q)[1] != 0).double() / 0.6
    torch.manual_seed(3)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(calls[0](fwAD.make_dual(q, tangent))[0]).tangent

    def formulas(z):
        return (torch.softmax(z @ k.transpose(-2, -1) / 8 ** 0.5, -1) * kept) @ v

    torch.testing.assert_close(got, jvp(formulas, (q,), (tangent,))[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_under_transforms_match_the_oracle(dtype):
    # Scores and softmax accumulate in float32, as in the op (a float16 score cannot hold -1e9).
    block, oracle = pair()
    block.to(dtype)
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})  # the rounded weights
    x, mask = batch()
    params = {name: p.detach() for name, p in block.named_parameters()}
    got = vmap(lambda xi, mi: functional_call(block, params, (xi[None],) * 3 + (mi[None],)))(x.to(dtype), mask)
    want = oracle(*(x.to(dtype).double(),) * 3, mask)[0][:, None]
    assert_close(got, want, dtype)
    got = grad(per_sample_loss(block))(params, x[0].to(dtype), mask[0])
    assert all(torch.isfinite(g).all() for g in got.values())


def test_forward_step_under_grad_matches_forward():
    block, _ = pair()
    x, _ = batch()
    causal = torch.ones(5, 5, dtype=torch.int64).tril()

    def stepped(x):
        outputs, cache = [], None
        for t in range(x.shape[1]):
            out, cache = block.forward_step(x[:, t:t + 1], cache)
            outputs.append(out)
        return torch.cat(outputs, 1).pow(2).sum()

    torch.testing.assert_close(grad(stepped)(x), grad(lambda x: block(x, x, x, causal).pow(2).sum())(x))


def test_static_attention_under_vmap_checks_and_applies_a_mask():
    q, k, v = (torch.randn(2, HEADS, 5, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 1, 5, dtype=torch.int64)
    mask[0, ..., 2:] = 0
    got, _ = vmap(lambda *a: fastmha.MultiHeadAttentionBlock.attention(*a, None))(q, k, v, mask)
    torch.testing.assert_close(got, oracle_attention(q, k, v, mask[:, None])[0])
    with pytest.raises(RuntimeError, match=r"mask of shape \[1, 6\] does not broadcast to the scores"):
        vmap(lambda *a: fastmha.MultiHeadAttentionBlock.attention(*a, None))(q, k, v, torch.ones(2, 1, 6))


def test_static_attention_under_grad():
    q, k, v = (torch.randn(2, HEADS, 5, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 1, 1, 5)
    mask[0, ..., 2:] = 0

    def loss(attend, q):
        out, weights = attend(q, k, v, mask)
        return out.sum() + weights.pow(2).sum()

    got = grad(lambda q: loss(lambda *a: fastmha.MultiHeadAttentionBlock.attention(*a, None), q))(q)
    want = grad(lambda q: loss(oracle_attention, q))(q)
    torch.testing.assert_close(got, want)


def test_bad_mask_under_a_transform_is_named():
    block, _ = pair()
    x, _ = batch()
    params = {name: p.detach() for name, p in block.named_parameters()}
    with pytest.raises(RuntimeError, match=r"mask of shape \[1, 4\] does not broadcast to the scores"):
        grad(per_sample_loss(block))(params, x[0], torch.ones(4))


def test_forward_set_on_the_instance_or_the_class_is_called():
    block, oracle = pair()
    x, mask = batch()
    plain = block.w_v.forward
    block.w_v.forward = lambda t: plain(t) * 2.0  # as offloading and adapter tools patch modules
    oracle_forward = oracle.w_v.forward
    oracle.w_v.forward = lambda t: oracle_forward(t) * 2.0
    torch.testing.assert_close(block(x, x, x, mask), oracle(x, x, x, mask)[0])
    del block.w_v.forward, oracle.w_v.forward
    linear_forward = nn.Linear.forward
    try:
        nn.Linear.forward = lambda self, t: linear_forward(self, t) + 1.0
        torch.testing.assert_close(block(x, x, x, mask), oracle(x, x, x, mask)[0])
    finally:
        nn.Linear.forward = linear_forward
    torch.testing.assert_close(block(x, x, x, mask), oracle(x, x, x, mask)[0])
    block.w_v.forward = block.w_v.forward  # the class's own forward left bound on the instance, as tools leave it
    names = OpCounter()
    with names:
        block(x, x, x, mask)
    assert "_multi_head_attention_forward" in names.names


class ScaledWeight(torch.Tensor):
    """A weight kept as (data, scale), as quantization libraries keep theirs; torch's ops see data * scale, other
    libraries' ops are not supported (as with such libraries' tensors)."""

    @staticmethod
    def __new__(cls, data, scale):
        tensor = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)
        tensor.stored, tensor.scale = data, scale
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.namespace != "aten":
            return NotImplemented

        def unwrap(t):
            return t.stored * t.scale if isinstance(t, ScaledWeight) else t
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_tensor_subclass_weight_is_used_through_its_module():
    block, oracle = pair()
    x, mask = batch()
    weight = block.w_k.weight.detach()
    del block.w_k.weight
    block.w_k.weight = ScaledWeight(weight / 4.0, 4.0)
    with torch.no_grad():
        torch.testing.assert_close(block(x, x, x, mask), oracle(x, x, x, mask)[0])


def random_op_calls():
    """The public ops with dropout 0.5, as functions of a query that vmap maps over (slices of (2, HEADS, 5, 4))."""
    torch.manual_seed(1)
    k, v = (torch.randn(2, HEADS, 6, 4) for _ in range(2))
    x, memory = torch.randn(2, 5, D_MODEL), torch.randn(2, 6, D_MODEL)
    ws = [torch.randn(D_MODEL, D_MODEL) / 4 for _ in range(4)]
    return {
        "attention": lambda q: torch.ops.fastmha.attention(q, k, v, None, 0.5, True, False),
        "multi_head_attention": lambda q: torch.ops.fastmha.multi_head_attention(
            x + q.transpose(1, 2).reshape(2, 5, D_MODEL), memory, memory, *ws, HEADS, None, 0.5, True, False),
        # A decoding step over a cache of 6 positions; its dropout is seen in the output only.
        "multi_head_attention_step": lambda q: torch.ops.fastmha.multi_head_attention_step(
            x[:, :1] + q[:, :, :1].transpose(1, 2).reshape(2, 1, D_MODEL), *ws, HEADS, k, v, None, 0.5),
    }


def test_vmap_of_the_ops_over_an_empty_dimension_is_refused_clearly():
    call = random_op_calls()["attention"]
    with pytest.raises(RuntimeError, match="does not support vmap over a dimension of size 0"):
        vmap(call, randomness="different")(torch.randn(0, 2, HEADS, 5, 4))


@pytest.mark.parametrize("op", ["attention", "multi_head_attention", "multi_head_attention_step"])
@pytest.mark.parametrize("randomness", ["error", "same", "different"])
def test_vmap_of_the_ops_with_dropout_follows_randomness(op, randomness):
    # As for torch's random ops: "error" (the default) raises, "same" gives every slice the mask the first call
    # from this generator state draws, "different" the masks of one call per slice in turn.
    call = random_op_calls()[op]
    queries = torch.randn(3, 2, HEADS, 5, 4)
    if randomness == "error":
        with pytest.raises(RuntimeError, match=r"random operation while in randomness error mode.*dropout_p=0.5"):
            vmap(call)(queries)
        return
    torch.manual_seed(7)
    got = vmap(call, randomness=randomness)(queries)
    after_vmap = torch.rand(4)
    wanted = []
    torch.manual_seed(7)
    for query in queries:
        start = torch.get_rng_state()
        wanted.append(call(query))
        if randomness == "same" and len(wanted) < len(queries):
            torch.set_rng_state(start)
    assert torch.equal(torch.rand(4), after_vmap)  # the generator moved as far as the calls above
    for got_part, parts in zip(got, zip(*wanted)):
        torch.testing.assert_close(got_part, torch.stack(parts))
    if op != "multi_head_attention_step":  # (the step keeps no weights)
        drops = [(weights == 0) for weights in got[1]]
        assert any(drop.any() for drop in drops)
        assert all(torch.equal(drops[0], drop) for drop in drops) == (randomness == "same")
