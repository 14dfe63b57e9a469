"""The attention ops' outputs take the memory layout of their inputs.

A (B, H, L, d) input that is the head split of a (B, L, H * d) tensor (``x.view(B, L, H, d).transpose(1, 2)``, as
the block and the textbook split their projections) gets its output, or its gradient, in that same (B, L, H, d)
memory, so that merging the heads back is a view; any other input gets contiguous ones. Values are checked against
the float64 oracle (dropout replayed from the Philox stream), strides against the rule, and the fake kernels'
strides against the real ones (opcheck).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import TOLERANCES
from layouts import contiguous
from layouts import heads_interleaved as interleaved
from oracle import oracle_attention
from philox_reference import expected_keep

OPS = torch.ops.fastmha


def expected_strides(t, heads_last):
    b, h, length, d = t.shape
    return (length * h * d, d, h * d, 1) if heads_last else (h * length * d, length * d, d, 1)


def assert_layout(t, heads_last):
    # Strides of dims of size 1 carry no meaning; compare the others.
    got = [s for s, n in zip(t.stride(), t.shape) if n > 1]
    want = [s for s, n in zip(expected_strides(t, heads_last), t.shape) if n > 1]
    assert got == want, f"strides {t.stride()} for shape {tuple(t.shape)}, expected {expected_strides(t, heads_last)}"


KERNELS = ["own", "stock", "own, half-type products"]


def use_kernels(monkeypatch, kernels, dtype):
    if kernels.endswith("products"):
        if dtype not in (torch.bfloat16, torch.float16):
            pytest.skip("products in the half type are for half types")
        # ATen's reference GEMM on any CPU: the same packing and strides as the native products.
        monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "reference")
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", kernels.split(",")[0])


LAYOUTS = {"all split": (True, True, True), "query split": (True, False, False), "keys split": (False, True, True)}
SHAPES = {"small": (2, 3, 13, 17, 8), "one head pair, many chunks": (1, 2, 300, 50, 16)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("need_weights,dropout_p", [(True, 0.0), (False, 0.0), (True, 0.25), (False, 0.25)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kernels", KERNELS)
def test_outputs_follow_the_inputs_layout(monkeypatch, layout, shape, dtype, need_weights, dropout_p, masked,
                                          kernels):
    use_kernels(monkeypatch, kernels, dtype)
    b, h, lq, lk, d = SHAPES[shape]
    split_q, split_k, split_v = LAYOUTS[layout]
    q = (interleaved if split_q else contiguous)(b, h, lq, d, dtype)
    k = (interleaved if split_k else contiguous)(b, h, lk, d, dtype)
    v = (interleaved if split_v else contiguous)(b, h, lk, d, dtype)
    mask = None
    if masked:  # a padding mask: the second sequence keeps 60% of its keys
        mask = torch.ones(b, 1, 1, lk, dtype=torch.bool)
        mask[-1, ..., int(0.6 * lk):] = False

    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, dropout_p, need_weights, False)
    assert_layout(out, split_q)
    grad_out = interleaved(b, h, lq, d, dtype) if split_q else contiguous(b, h, lq, d, dtype)
    dq, dk, dv = OPS._attention_backward(grad_out, None, q, k, v, mask, out, lse, rng_state, dropout_p, False)
    assert_layout(dq, split_q)
    assert_layout(dk, split_k)
    assert_layout(dv, split_v)

    keep = None
    if dropout_p > 0:
        seed, offset = (int(x) for x in rng_state)
        keep = expected_keep(seed & (2**64 - 1), offset, (b, h, lq, lk), dropout_p)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref_inputs, mask, keep, dropout_p)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.double())
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref_out, **tolerance)
    if need_weights:
        torch.testing.assert_close(weights.double(), ref_weights, **tolerance)
    for got, want in zip((dq, dk, dv), ref_grads):
        torch.testing.assert_close(got.double(), want, **tolerance)


GRAD_OUTPUTS = {
    "like the output": None,
    "contiguous": lambda g: g.contiguous(),
    "split": lambda g: g.transpose(1, 2).contiguous().transpose(1, 2),
    "broadcast over batch and heads": lambda g: g[:1, :1].expand_as(g),
}


@pytest.mark.parametrize("grad_layout", list(GRAD_OUTPUTS))
@pytest.mark.parametrize("split_q", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kernels", KERNELS)
def test_gradients_from_any_output_gradient_layout(monkeypatch, grad_layout, split_q, dtype, need_weights, kernels):
    # d_v differs from d_k; the output gradient comes in any layout, also one that differs from the output's.
    use_kernels(monkeypatch, kernels, dtype)
    b, h, lq, lk, d_k, d_v = 2, 3, 11, 14, 8, 12
    q = (interleaved if split_q else contiguous)(b, h, lq, d_k, dtype)
    k = interleaved(b, h, lk, d_k, dtype)
    v = interleaved(b, h, lk, d_v, dtype)
    mask = torch.rand(b, 1, lq, lk) > 0.3
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, 0.0, need_weights, False)
    assert out.shape == (b, h, lq, d_v)
    assert_layout(out, split_q)
    grad_out = torch.randn(b, h, lq, d_v, dtype=dtype)
    if GRAD_OUTPUTS[grad_layout] is not None:
        grad_out = GRAD_OUTPUTS[grad_layout](grad_out)
    dq, dk, dv = OPS._attention_backward(grad_out, None, q, k, v, mask, out, lse, rng_state, 0.0, False)
    assert_layout(dq, split_q)
    assert_layout(dk, True)
    assert_layout(dv, True)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_inputs, mask)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.double())
    for got, want in zip((dq, dk, dv), ref_grads):
        torch.testing.assert_close(got.double(), want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("b,h,d", [(0, 2, 8), (0, 1, 8)])
def test_empty_inputs_with_interleaved_heads(dtype, need_weights, b, h, d):
    # Enough query rows (130) for the forward's tasks to copy interleaved heads, but nothing to copy.
    q, k, v = (interleaved(b, h, n, d, dtype).requires_grad_() for n in (130, 140, 140))
    out, weights = OPS.attention(q, k, v, None, 0.0, need_weights, False)
    ref_out, ref_weights = oracle_attention(q.detach(), k.detach(), v.detach())
    assert out.shape == ref_out.shape and (not need_weights or weights.shape == ref_weights.shape)
    torch.testing.assert_close(out, ref_out)
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.count_nonzero(t.grad) == 0


def test_the_public_op_and_autograd_keep_the_layout():
    q, k, v = (interleaved(2, 4, 9, 8, torch.float32).requires_grad_() for _ in range(3))
    out, _ = OPS.attention(q, k, v, None, 0.0, False, False)
    assert_layout(out, True)
    # The textbook's head merge is then a view of the same memory.
    merged = out.transpose(1, 2).contiguous()
    assert merged.data_ptr() == out.data_ptr()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert_layout(t.grad, True)


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kernels", ["own", "stock"])
@pytest.mark.parametrize("len_q", [5, 1])  # one query: a decoding step, a dim of size 1
def test_fake_kernels_give_the_real_strides(monkeypatch, device, mask_kind, is_causal, kernels, len_q):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", kernels)
    q, k, v = (interleaved(2, 3, n, 4, torch.float64).to(device) for n in (len_q, 6, 6))
    mask = None if mask_kind == "none" else torch.rand(2, 1, 1, 6, device=device) > 0.3
    torch.library.opcheck(OPS.attention.default, (q.requires_grad_(), k, v.requires_grad_(), mask, 0.0, False, is_causal))
    q, v = q.detach(), v.detach()
    torch.library.opcheck(OPS._attention_forward.default, (q, k, v, mask, 0.0, True, is_causal))
    out, _, lse, rng_state = OPS._attention_forward(q, k, v, mask, 0.0, False, is_causal)
    torch.library.opcheck(OPS._attention_backward.default,
                          (torch.randn_like(out), None, q, k, v, mask, out, lse, rng_state, 0.0, is_causal))
    # Mixed layouts: each gradient takes the layout of its own input.
    kc = k.contiguous()
    grad_out = torch.randn_like(out)
    torch.library.opcheck(OPS._attention_backward.default,
                          (grad_out, None, q, kc, v, mask, out, lse, rng_state, 0.0, is_causal))
    # The same strides, spelled out: real outputs against those of the fake kernels.
    real = OPS._attention_backward(grad_out, None, q, kc, v, mask, out, lse, rng_state, 0.0, is_causal)
    args = (grad_out, q, kc, v, mask, out, lse, rng_state)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [None if t is None else mode.from_tensor(t) for t in args]
        g, fq, fk, fv, fmask, fout, flse, frng = fake_args
        fake_out = OPS._attention_forward(fq, fk, fv, fmask, 0.0, False, is_causal)[0]
        fake = OPS._attention_backward(g, None, fq, fk, fv, fmask, fout, flse, frng, 0.0, is_causal)
    assert fake_out.stride() == out.stride()
    assert [t.stride() for t in fake] == [t.stride() for t in real]
