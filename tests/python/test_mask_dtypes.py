"""A mask of any real dtype means `mask != 0` (NaN included): the attention op and the block convert it to bool
once for the forward and the backward. Outputs, weights and gradients must be bitwise those of the bool mask
`mask != 0` (the bool path itself is checked against the oracle elsewhere), with the same dropout, and the
user's mask must come back unchanged."""

import os
import subprocess
import sys

import pytest
import torch

import fastmha

B, H, L, D_MODEL = 2, 2, 37, 16
MASK_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.int8, torch.float32, torch.float64, torch.float16,
               torch.bfloat16]


def padded_causal_values(dtype):
    """A (B, 1, L, L) padding & causal mask of values 0 and other nonzeros (negative, fractional, NaN)."""
    keep = (torch.arange(L) < torch.tensor([30, 9])[:, None])[:, None, None, :] & torch.ones(L, L).tril().bool()
    if dtype.is_floating_point:
        values = torch.tensor([1.0, -2.5, 0.25, float("nan")], dtype=dtype)
    else:
        values = torch.tensor([1, 3, 7, 1], dtype=dtype)
    filled = values[torch.arange(L * L).reshape(L, L) % 4].expand(B, 1, L, L)
    return torch.where(keep, filled, torch.zeros((), dtype=dtype))


def run_core(mask, grad_enabled):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, 8, dtype=torch.float64, requires_grad=grad_enabled) for _ in range(3))
    torch.manual_seed(1)
    with torch.set_grad_enabled(grad_enabled):
        out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.2, True, False)
        if not grad_enabled:
            return out, weights
        grads = torch.autograd.grad((out * out).sum() + weights.sum(), (q, k, v))
    return out, weights, *grads


def run_block(mask, grad_enabled):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, H, 0.2).double()
    x = torch.randn(B, L, D_MODEL, dtype=torch.float64, requires_grad=grad_enabled)
    torch.manual_seed(1)
    with torch.set_grad_enabled(grad_enabled):
        out = block(x, x, x, mask)
        if not grad_enabled:
            return out, block.attention_scores
        grads = torch.autograd.grad(out.square().sum(), (x, *block.parameters()))
    return out, block.attention_scores, *grads


@pytest.mark.parametrize("grad_enabled", [True, False], ids=["training", "no grad"])
@pytest.mark.parametrize("run", [run_core, run_block], ids=["attention op", "block"])
@pytest.mark.parametrize("dtype", MASK_DTYPES, ids=str)
def test_a_mask_of_any_dtype_is_its_nonzeros(dtype, run, grad_enabled):
    mask = padded_causal_values(dtype)
    before = mask.clone()
    version = mask._version
    got = run(mask, grad_enabled)
    want = run(mask != 0, grad_enabled)
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan())
        assert torch.equal(g.nan_to_num(), w.nan_to_num())
    assert mask.dtype == dtype and mask._version == version
    assert torch.equal(mask.isnan(), before.isnan()) and torch.equal(mask.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("run", [run_core, run_block], ids=["attention op", "block"])
def test_a_complex_mask_is_refused_by_name_and_dtype(run):
    mask = torch.ones(B, 1, 1, L, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match=r"mask must be a real or bool tensor, got .*ComplexFloat"):
        run(mask, True)


def saved_tensors_of(call):
    """The tensors autograd saves for the backward during call()."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return saved


@pytest.mark.parametrize("op", ["attention op", "block"])
@pytest.mark.parametrize("length, converted", [(40, True), (1100, False)], ids=["small", "large"])
def test_a_small_mask_is_saved_as_bool_and_a_large_one_as_passed(op, length, converted):
    # Bool, the backward reads a small mask without converting it again; a large one (over 2**20 elements) is
    # saved as the user's tensor, so that many layers sharing it hold no copy each.
    mask = (torch.rand(1, 1, length, length) > 0.2).to(torch.int64)
    if op == "attention op":
        q, k, v = (torch.randn(1, 1, length, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
        saved = saved_tensors_of(lambda: torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, False))
    else:
        block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0).double()
        x = torch.randn(1, length, 8, dtype=torch.float64, requires_grad=True)
        saved = saved_tensors_of(lambda: block(x, x, x, mask))
    masks = [t for t in saved if t.shape == mask.shape]
    assert len(masks) == 1
    if converted:
        assert masks[0].dtype == torch.bool and torch.equal(masks[0], mask != 0)
    else:
        assert masks[0] is mask or masks[0].data_ptr() == mask.data_ptr()


@pytest.mark.parametrize("kernels", ["own", "stock"])
def test_expanded_integer_mask_is_not_converted_at_its_expanded_size(kernels):
    # A (1, 1, 1, L) int64 mask expanded to (1, 1, L, L): converted at its size, read through zero strides. At the
    # expanded size its bool copy alone would be 64 MiB (and the stock layer's float bias 256 MiB more). In a
    # fresh process, whose peak resident memory tells.
    script = """
import resource, torch, fastmha
L = 8192
q, k, v = (torch.randn(1, 1, L, 8, requires_grad=True) for _ in range(3))
small = (torch.arange(L) < L - 5).long().view(1, 1, 1, L)
def run(mask):
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False)
    out.sum().backward()
    return out
ref = run(small)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = run(small.expand(1, 1, L, L))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, torch.equal(out, ref))
"""
    env = {**os.environ, "FASTMHA_CPU_KERNELS": kernels}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    grown_kib, same = result.stdout.split()
    assert same == "True"
    assert int(grown_kib) < 32 * 1024, f"peak memory grew by {grown_kib} KiB"


@pytest.mark.parametrize("kernels", ["own", "stock"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_large_mask_converted_into_a_kept_buffer_is_each_calls_own(kernels, dtype, layout, monkeypatch):
    # A mask of 4 Mi elements is converted into a buffer of the CPU kernels' pool, which a later call takes again:
    # each call must see its own mask, never the previous call's conversion. Floating zeros of both signs hide.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", kernels)
    batch, length = 4, 1024
    q, k, v = (torch.randn(batch, 1, length, 4, requires_grad=True) for _ in range(3))
    lengths = [torch.tensor([1000, 300, 700, 5]), torch.tensor([17, 1024, 600, 900])]
    for kept in lengths:
        keep = (torch.arange(length) < kept[:, None])[:, None, None, :] & torch.ones(length, length).tril().bool()
        values = torch.tensor([1, 3, 2, 5], dtype=dtype) if not dtype.is_floating_point else \
            torch.tensor([1.0, -0.5, float("nan"), 4.0], dtype=dtype)
        zeros = torch.tensor([0.0, -0.0], dtype=dtype)[torch.arange(length) % 2]
        mask = torch.where(keep, values[torch.arange(length) % 4], zeros)
        if layout == "transposed":  # the same values, keys the outer dimension in memory
            mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
        before = mask.clone()
        got = [torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, False)[0]]
        got += torch.autograd.grad(got[0].square().sum(), (q, k, v))
        want = [torch.ops.fastmha.attention(q, k, v, mask != 0, 0.0, False, False)[0]]
        want += torch.autograd.grad(want[0].square().sum(), (q, k, v))
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(mask.isnan(), before.isnan()) and torch.equal(mask.nan_to_num(), before.nan_to_num())
