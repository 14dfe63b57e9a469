"""The block's projections in bfloat16/float16 on a CPU that does not multiply the type natively are computed
in fp32 from the half-type values and rounded once (torch's half-type products there are several times slower).
Each product must then be the exact product rounded to the half type, within one rounding of the fp32 sum, forward
(query, key, value and output projections, and the step op's) and backward (input and weight gradients, with
the rows a padding mask zeroes skipped or not).
"""

import pytest
import torch
import torch.nn.functional as F

import fastmha
from conftest import TOLERANCES, assert_close
from oracle import OracleBlock

HALF_TYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def assert_fp32_product(got, x, w):
    """got = x W^T accumulated in fp32 from the half-type values and rounded once: within one unit in the last
    place of the half type plus fp32's accumulation error bound (n * 2^-24 * sum of |terms|) of the exact
    product. A sum accumulated in the half type would be off by about n * 2^-8 * sum of |terms|."""
    exact = x.double() @ w.double().t()
    terms = x.double().abs() @ w.double().abs().t()
    ulp = 2.0 ** -7 if got.dtype == torch.bfloat16 else 2.0 ** -10
    bound = ulp * exact.abs() + x.shape[-1] * 2.0 ** -24 * terms
    assert got.dtype == x.dtype
    excess = (got.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"max excess {excess.max().item():.3g}"


def test_cpu_native_products_names_the_half_types():
    for name in HALF_TYPES.values():
        assert isinstance(fastmha._C.cpu_native_products(name), bool)
    assert fastmha._C.cpu_native_products("float32") is False


def test_cpu_widens_products_where_the_cpu_lacks_native_products():
    previous = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(precision)
            assert fastmha._C.cpu_widens_products("bfloat16", 64) is not fastmha._C.cpu_native_products("bfloat16")
            float16_widened = precision != "medium" and not fastmha._C.cpu_native_products("float16")
            assert fastmha._C.cpu_widens_products("float16", 64) is float16_widened
            assert fastmha._C.cpu_widens_products("float32", 64) is False
            for name in HALF_TYPES.values():  # a decoding step's token stays in the half type
                assert fastmha._C.cpu_widens_products(name, 1) is False
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("dtype", list(HALF_TYPES))
@pytest.mark.parametrize("masked", [False, True])
def test_projections_are_the_exact_products_rounded_once(dtype, masked):
    torch.manual_seed(0)
    b, length, d_model, h = 2, 40, 256, 4
    # Long dot products whose terms cancel: a half-type running sum would be many units off.
    x = (torch.randn(b, length, d_model) * 8).to(dtype)
    weights = [(torch.randn(d_model, d_model) / 16).to(dtype) for _ in range(4)]
    mask = None
    if masked:  # keys past each length are seen by no query: those key/value rows are left out
        mask = (torch.arange(length)[None, :] < torch.tensor([length, 13])[:, None])[:, None, None, :]
    output, _, query_proj, key_proj, value_proj, context, _, _ = torch.ops.fastmha._multi_head_attention_forward(
        x, x, x, *weights, h, mask, 0.0, False, False)
    assert_fp32_product(query_proj, x, weights[0])
    if fastmha._C.cpu_widens_products(HALF_TYPES[dtype], b * length):  # widened: the fp32 product rounded, bit for bit
        assert torch.equal(query_proj, F.linear(x.float(), weights[0].float()).to(dtype))
        assert torch.equal(output, F.linear(context.float(), weights[3].float()).to(dtype))
    seen = slice(None) if mask is None else mask[1, 0, 0]
    assert_fp32_product(key_proj[1, seen], x[1, seen], weights[1])
    assert_fp32_product(value_proj[1, seen], x[1, seen], weights[2])
    assert_fp32_product(output, context, weights[3])


@pytest.mark.parametrize("dtype", list(HALF_TYPES))
@pytest.mark.parametrize("masked", [False, True])
def test_block_gradients_match_the_oracle(dtype, masked):
    torch.manual_seed(1)
    b, length, d_model, h = 2, 24, 64, 4
    block = fastmha.MultiHeadAttentionBlock(d_model, h, 0.0).to(dtype)
    oracle = OracleBlock(d_model, h).double()
    oracle.load_state_dict({k: v.double() for k, v in block.state_dict().items()})
    x = torch.randn(b, length, d_model, dtype=dtype, requires_grad=True)
    x_ref = x.detach().double().requires_grad_()
    mask = None
    if masked:  # padded queries get no gradient: their rows of dy are zero and skipped
        mask = (torch.arange(length)[None, :] < torch.tensor([length, 5])[:, None])[:, None, None, :]
    grad = torch.randn(b, length, d_model, dtype=dtype)
    if masked:
        grad[1, 5:] = 0
    out = block(x, x, x, mask)
    ref, _ = oracle(x_ref, x_ref, x_ref, mask)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    out.backward(grad)
    ref.backward(grad.double())
    assert_close(x.grad, x_ref.grad, dtype)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        got, want = getattr(block, name).weight.grad, getattr(oracle, name).weight.grad
        assert got.dtype == dtype
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", list(HALF_TYPES))
def test_step_projections_are_the_exact_products_rounded_once(dtype):
    torch.manual_seed(2)
    b, length, d_model, h = 1, 6, 128, 4
    x = (torch.randn(b, length, d_model) * 8).to(dtype)
    weights = [(torch.randn(d_model, d_model) / 16).to(dtype) for _ in range(4)]
    _, keys, values = torch.ops.fastmha.multi_head_attention_step(x, *weights, h, None, None, None, 0.0)
    assert_fp32_product(keys.transpose(1, 2).reshape(b, length, d_model), x, weights[1])
    assert_fp32_product(values.transpose(1, 2).reshape(b, length, d_model), x, weights[2])


def test_float16_is_not_widened_where_float32_products_may_round_to_bfloat16():
    # Under matmul precision "medium" an fp32 product may round its operands to bfloat16, losing float16 bits:
    # the projections stay torch's float16 products.
    torch.manual_seed(3)
    x = torch.randn(1, 8, 64, dtype=torch.float16)
    weights = [torch.randn(64, 64, dtype=torch.float16) / 8 for _ in range(4)]
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        query_proj = torch.ops.fastmha._multi_head_attention_forward(x, x, x, *weights, 4, None, 0.0, False, False)[2]
    finally:
        torch.set_float32_matmul_precision(previous)
    assert torch.equal(query_proj, F.linear(x, weights[0]))


@pytest.mark.parametrize("dtype", list(HALF_TYPES))
def test_one_tensor_as_query_key_and_value_gives_the_bits_of_three(dtype):
    # Self-attention's one input is widened once for its three projections, forward and backward: the products
    # must be the ones three separate inputs get, bit for bit (the input's own gradient is their sum, below).
    torch.manual_seed(4)
    b, length, d_model, h = 2, 33, 64, 4
    block = fastmha.MultiHeadAttentionBlock(d_model, h, 0.0).to(dtype)
    x = torch.randn(b, length, d_model, dtype=dtype)
    grad = torch.randn(b, length, d_model, dtype=dtype)
    shared = x.clone().requires_grad_()
    out_shared = block(shared, shared, shared, None)
    out_shared.backward(grad)
    weight_grads = [getattr(block, name).weight.grad.clone() for name in ("w_q", "w_k", "w_v", "w_o")]
    block.zero_grad(set_to_none=True)
    inputs = [x.clone().requires_grad_() for _ in range(3)]
    out_three = block(*inputs, None)
    out_three.backward(grad)
    assert torch.equal(out_shared, out_three)
    for name, got in zip(("w_q", "w_k", "w_v", "w_o"), weight_grads):
        assert torch.equal(got, getattr(block, name).weight.grad), name
    # The shared input's three gradients are added up by the products (in fp32 where they are widened), where
    # autograd adds the three inputs' gradients in the half type: within a rounding of each other.
    torch.testing.assert_close(shared.grad, inputs[0].grad + inputs[1].grad + inputs[2].grad, **TOLERANCES[dtype])


def half_to_float32_copies(prof, shape):
    """How many tensors of `shape` the profiled ops converted to float32: in a half-type block, half-type ones (a
    float32 tensor's .to(float32) is itself, no copy)."""
    float32 = 6  # torch.float32's ScalarType, as the profile records _to_copy's dtype argument
    return sum(1 for e in prof.events()
               if e.name == "aten::_to_copy" and e.input_shapes and list(e.input_shapes[0]) == list(shape)
               and e.concrete_inputs[1] == float32)


def widenings_of_shape(block, inputs, grad, shape):
    """The copies of half-type tensors of `shape` to float32 that the block's forward, then its backward, makes."""
    with torch.profiler.profile(record_shapes=True) as forward:
        out = block(*inputs, None)
    with torch.profiler.profile(record_shapes=True) as backward:
        out.backward(grad)
    return half_to_float32_copies(forward, shape), half_to_float32_copies(backward, shape)


@pytest.mark.parametrize("dtype", list(HALF_TYPES))
def test_one_tensor_as_query_key_and_value_is_widened_once(dtype):
    # Widening reads and writes the whole input: self-attention's one input is widened once in the forward and
    # once in the backward, two copies fewer in each than three inputs of its shape need.
    b, length, d_model, h = 2, 33, 64, 4
    if not fastmha._C.cpu_widens_products(HALF_TYPES[dtype], b * length):
        pytest.skip("this CPU multiplies the type natively: nothing is widened")
    torch.manual_seed(6)
    block = fastmha.MultiHeadAttentionBlock(d_model, h, 0.0).to(dtype)
    x = torch.randn(b, length, d_model, dtype=dtype)
    grad = torch.randn(b, length, d_model, dtype=dtype)
    shared = x.clone().requires_grad_()
    three = [x.clone().requires_grad_() for _ in range(3)]
    shared_forward, shared_backward = widenings_of_shape(block, [shared] * 3, grad, x.shape)
    three_forward, three_backward = widenings_of_shape(block, three, grad, x.shape)
    assert three_forward >= 3 and three_backward >= 3  # the profile sees each input's copy
    assert shared_forward == three_forward - 2
    assert shared_backward == three_backward - 2


@pytest.mark.parametrize("dtype", list(HALF_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 7])
def test_a_few_rows_are_torch_products_and_more_are_widened(dtype, rows):
    # A decoding step of one token (or a few) keeps torch's half-type product, which multiplies so few rows faster
    # than widening the whole weight; both accumulate in fp32.
    torch.manual_seed(5)
    d_model, h = 128, 4
    x = (torch.randn(1, rows, d_model) * 8).to(dtype)
    weights = [(torch.randn(d_model, d_model) / 16).to(dtype) for _ in range(4)]
    _, keys, _ = torch.ops.fastmha.multi_head_attention_step(x, *weights, h, None, None, None, 0.0)
    key_rows = keys.transpose(1, 2).reshape(1, rows, d_model)
    assert_fp32_product(key_rows, x, weights[1])
    if fastmha._C.cpu_widens_products(HALF_TYPES[dtype], rows):
        assert rows >= 6
        assert torch.equal(key_rows, F.linear(x.float(), weights[1].float()).to(dtype))
    else:
        assert torch.equal(key_rows, F.linear(x, weights[1]))
