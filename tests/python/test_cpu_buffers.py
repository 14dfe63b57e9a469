"""The CPU kernels keep freed buffers of 4 MiB and more (kept weights, outputs, the backward's partial
gradients) for later calls of about their size. A reused buffer holds the last call's numbers: every result
must still be what the math gives, in particular the zeros of kept weights at keys a mask skips."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_close
from oracle import oracle_attention

import fastmha

B, H, L, D = 2, 4, 512, 32  # kept weights of 8 MiB


def inputs(seed, length=L, d=D):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, length, d, generator=g, dtype=torch.float64).float() for _ in range(3)]


reuse_on = pytest.mark.skipif(os.environ.get("FASTMHA_CPU_REUSE_BUFFERS") == "0",
                              reason="FASTMHA_CPU_REUSE_BUFFERS=0: no buffer is kept")


@reuse_on
def test_reused_weights_buffer_holds_exact_zeros_where_a_mask_skips_keys():
    fastmha.release_cpu_buffers()
    _, first = torch.ops.fastmha.attention(*inputs(0), None, 0.0, True)
    assert bool((first > 0).all())  # no mask: every weight of the first call is positive
    memory = first.data_ptr()
    del first, _
    assert fastmha.cached_cpu_buffer_bytes() >= B * H * L * L * 4

    mask = (torch.arange(L) < torch.tensor([100, 300])[:, None])[:, None, None, :]  # (B, 1, 1, L) padding
    q, k, v = inputs(1)
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True)
    assert weights.data_ptr() == memory  # the same memory, with the last call's numbers in it
    ref_out, ref_weights = oracle_attention(q.double(), k.double(), v.double(), mask)
    assert bool((weights[0, :, :, 100:] == 0).all()) and bool((weights[1, :, :, 300:] == 0).all())
    assert_close(weights, ref_weights, torch.float32)
    assert_close(out, ref_out, torch.float32)


@reuse_on
def test_gradients_computed_in_reused_buffers(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    fastmha.release_cpu_buffers()
    freed = set()
    for seed in (0, 1):  # the second call runs in the first one's freed buffers (each tensor is 4 MiB)
        q, k, v = (t.requires_grad_() for t in inputs(seed, length=1024, d=128))
        out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        got = torch.autograd.grad(out, (q, k, v), grad)
        if seed == 1:
            assert {out.data_ptr(), got[0].data_ptr()} <= freed
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(oracle_attention(*ref)[0], ref, grad.double())
        for g, w in zip(got, want):
            assert_close(g, w, torch.float32)
        freed = {out.data_ptr(), *(g.data_ptr() for g in got)}
        del out, got


@reuse_on
def test_release_frees_the_kept_buffers():
    fastmha.release_cpu_buffers()
    torch.ops.fastmha.attention(*inputs(0), None, 0.0, True)  # freed at once: kept for reuse
    assert fastmha.cached_cpu_buffer_bytes() >= B * H * L * L * 4
    fastmha.release_cpu_buffers()
    assert fastmha.cached_cpu_buffer_bytes() == 0


def test_profiler_sees_the_buffers():
    with torch.profiler.profile(profile_memory=True) as prof:
        torch.ops.fastmha.attention(*inputs(0), None, 0.0, True)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.name == "fastmha::_attention_forward")
    assert allocated >= B * H * L * L * 4


@reuse_on
def test_profiler_sees_a_reused_buffer_freed_as_large_as_it_was_taken():
    # A kept buffer serves a request of down to half its size: the profiler must be told its own size both ways.
    fastmha.release_cpu_buffers()
    torch.ops.fastmha.attention(*inputs(0), None, 0.0, True)  # 8 MiB of weights, kept when freed
    smaller = inputs(1, length=400)  # 5 MiB of weights: served by the kept buffer
    with torch.profiler.profile(profile_memory=True) as prof:
        torch.ops.fastmha.attention(*smaller, None, 0.0, True)
    taken = sum(e.cpu_memory_usage for e in prof.events() if e.name == "fastmha::_attention_forward")
    freed = -min(e.cpu_memory_usage for e in prof.events() if e.name == "[memory]")  # the weights, after the call
    assert freed == B * H * L * L * 4 and taken >= freed


def test_reuse_can_be_turned_off():
    code = ("import torch, fastmha; q = torch.randn(2, 4, 512, 32); "
            "torch.ops.fastmha.attention(q, q, q, None, 0.0, True); print(fastmha.cached_cpu_buffer_bytes())")
    env = dict(os.environ, FASTMHA_CPU_REUSE_BUFFERS="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            check=True)
    assert result.stdout.strip() == "0"
    env.pop("FASTMHA_CPU_REUSE_BUFFERS")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            check=True)
    assert int(result.stdout.strip()) >= 2 * 4 * 512 * 512 * 4
