"""The fused CPU kernels at their edges: chunk boundaries, split backward, thread counts, CPU variants."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_close
from oracle import oracle_attention
from philox_reference import expected_keep

import fastmha  # noqa: F401


def qkv(b, h, lq, lk, d, dtype=torch.float64, requires_grad=False):
    return [torch.randn(b, h, n, d, dtype=dtype, requires_grad=requires_grad) for n in (lq, lk, lk)]


# Query chunks are 128 rows up to Lk = 4096 (64 at Lk = 8193): lengths on both sides of them, primes and 1.
@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 97), (31, 33), (127, 129), (128, 5), (129, 3), (131, 7), (257, 64),
                                   (65, 8193)])
def test_chunk_boundaries_forward_and_backward(lq, lk):
    q, k, v = qkv(1, 2, lq, lk, 8, requires_grad=True)
    mask = torch.rand(lq, lk) > 0.2
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True)
    ref_out, ref_weights = oracle_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(weights, ref_weights)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(ref_out, (q, k, v), grad)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


def test_backward_splits_a_single_head_across_threads():
    # batch * heads = 1 with many query chunks: the backward splits the chunks and sums partial dK/dV.
    q, k, v = qkv(1, 1, 300, 200, 16, requires_grad=True)
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(oracle_attention(q, k, v)[0].sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


def run_with_dropout(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(7)
        q, k, v = qkv(2, 3, 130, 90, 16, dtype=torch.float32, requires_grad=True)
        torch.manual_seed(8)
        out, weights = torch.ops.fastmha.attention(q, k, v, None, 0.2, True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        return out, weights, grads
    finally:
        torch.set_num_threads(previous)


def test_dropout_bit_reproducible_across_thread_counts():
    one = run_with_dropout(1)
    two = run_with_dropout(2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    for a, b in zip(one[2], two[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # partial-sum order may differ in dK/dV


def test_dropout_same_mask_with_and_without_weights():
    q, k, v = qkv(2, 2, 70, 80, 8, requires_grad=True)
    torch.manual_seed(3)
    out_w, weights = torch.ops.fastmha.attention(q, k, v, None, 0.3, True)
    torch.manual_seed(3)
    out_nw, none = torch.ops.fastmha.attention(q, k, v, None, 0.3, False)
    assert none.numel() == 0
    torch.testing.assert_close(out_w, out_nw)
    keep = weights != 0
    ref_out, _ = oracle_attention(q, k, v, keep=keep, p=0.3)
    torch.testing.assert_close(out_nw, ref_out)
    grads = torch.autograd.grad(out_nw.sum(), (q, k, v))
    ref = torch.autograd.grad(ref_out.sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


SCRIPT = """
import os, torch, fastmha
torch.manual_seed(0)
q, k, v = (torch.randn(2, 2, 77, 24, dtype=torch.float64) for _ in range(3))
mask = torch.rand(2, 1, 77, 77) > 0.3
out, w = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, True)
# Kept weights of over 16 MiB (written with non-temporal stores where the ISA has them), with dropout.
big = [torch.randn(1, 4, 1030, 16) for _ in range(3)]
padding = (torch.arange(1030) < 700)[None, None, None, :]
big_out, big_w, _, rng_state = torch.ops.fastmha._attention_forward(*big, padding, 0.3, True, False)
multipliers = torch.ops.fastmha._dropout_multipliers(list(big_w.shape), 0.3, torch.float32, rng_state)
# Decoding steps in half types through fastmha's widened products (keys and values read as they are), and float32
# products small enough for the kernels' own loops.
os.environ.update(FASTMHA_CPU_KERNELS="own", FASTMHA_CPU_HALF_GEMM="widen")
steps = []
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    sq, sk, sv = (torch.randn(2, 3, n, d, dtype=dtype) for n, d in ((1, 40), (300, 40), (300, 48)))
    steps.append((sq, sk, sv, torch.ops.fastmha.attention(sq, sk, sv, padding[..., :300], 0.0, False, False)[0]))
torch.save((q, k, v, mask, out, w, big, padding, big_out, big_w, rng_state, multipliers, steps), {path!r})
print(fastmha._C.cpu_capability())
"""


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_every_cpu_variant_matches_the_oracle(tmp_path, capability):
    path = str(tmp_path / "result.pt")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(path=path)], env=env, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() in (capability, "default")  # avx2 falls back where the CPU lacks it
    q, k, v, mask, out, w, big, padding, big_out, big_w, rng_state, multipliers, steps = torch.load(path)
    for sq, sk, sv, step_out in steps:
        ref_out, _ = oracle_attention(sq.double(), sk.double(), sv.double(), padding[..., :300])
        assert_close(step_out, ref_out, sq.dtype)
    causal = torch.tril(torch.ones(77, 77, dtype=torch.bool))
    ref_out, ref_w = oracle_attention(q, k, v, mask & causal)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(w, ref_w)
    # Dropout: the Philox stream's draws, bit for bit; values against the oracle given those draws.
    seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
    keep = expected_keep(seed, offset, tuple(big_w.shape), 0.3)
    assert torch.equal(big_w != 0, keep & padding)
    # The replay of that stream (the double backward's) draws it with the same variant's code.
    assert torch.equal(multipliers, keep.float() * torch.tensor(1 / (1 - 0.3), dtype=torch.float32))
    ref_out, ref_w = oracle_attention(*(t.double() for t in big), padding, keep=keep, p=0.3)
    torch.testing.assert_close(big_w, ref_w.float(), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(big_out, ref_out.float(), atol=1e-5, rtol=1e-4)
