"""fastmha's CUDA paths against the float64 oracle (skipped without a CUDA device).

Every test runs with the default kernel choice (fastmha's row kernels for kept weights; for need_weights=False
SDPA's fused kernels behind the contract layer without a mask or dropout, else fastmha's flash kernels in half
types and the ATen composite in float32), with FASTMHA_CUDA_KERNELS=own (fastmha's flash kernels for
need_weights=False), and with that and FASTMHA_CUDA_FLASH=mma or mma16 (the register-resident forward and
backward in half types with head sizes up to 128); the tests of masked and dropout calls (marked `sdpa`) once more
with FASTMHA_CUDA_MASKED=sdpa and FASTMHA_CUDA_DROPOUT=sdpa (SDPA's memory-efficient kernel given the contract
layer's bias, drawing torch's own dropout masks). Forward and
backward, across every padded head size (64/128/256, d_v != d_k), lengths around the tile edges, broadcast
masks of several dtypes with fully masked rows, is_causal with block skipping, dropout (reproducible, shared
by both paths, replayed by the backward), strided inputs, side streams, CUDA graphs and gradcheck in float64.
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import TOLERANCES
from oracle import oracle_attention
from torch.autograd import gradcheck
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastmha  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Gradients go through more roundings than outputs: twice the output tolerance for the half types. In float32 a
# key's gradient sums hundreds of query rows' rounding (even where it is 0 in the math, as for a single key).
GRAD_TOLERANCES = {**TOLERANCES, torch.float32: dict(atol=5e-5, rtol=2e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
                   torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}


# The switches of each mode. own-mma(16): the register-resident mma kernels where they apply (half types,
# d <= 128). sdpa-switches: masked and dropout calls without weights go to SDPA's memory-efficient kernel.
KERNEL_MODES = {"auto": {"FASTMHA_CUDA_KERNELS": "auto"}, "own": {"FASTMHA_CUDA_KERNELS": "own"},
                "own-mma": {"FASTMHA_CUDA_KERNELS": "own", "FASTMHA_CUDA_FLASH": "mma"},
                "own-mma16": {"FASTMHA_CUDA_KERNELS": "own", "FASTMHA_CUDA_FLASH": "mma16"},
                "sdpa-switches": {"FASTMHA_CUDA_KERNELS": "auto", "FASTMHA_CUDA_MASKED": "sdpa",
                                  "FASTMHA_CUDA_DROPOUT": "sdpa"}}


@pytest.fixture(autouse=True, params=list(KERNEL_MODES))
def kernel_mode(request, monkeypatch):
    if request.param == "sdpa-switches" and request.node.get_closest_marker("sdpa") is None:
        pytest.skip("no masked or dropout call: the same kernels as auto")
    for name in ("FASTMHA_CUDA_FLASH", "FASTMHA_CUDA_MASKED", "FASTMHA_CUDA_DROPOUT"):  # whatever the environment held
        monkeypatch.delenv(name, raising=False)
    for name, value in KERNEL_MODES[request.param].items():
        monkeypatch.setenv(name, value)
    return request.param


def attention(q, k, v, mask=None, dropout_p=0.0, need_weights=False, is_causal=False):
    return torch.ops.fastmha.attention(q, k, v, mask, dropout_p, need_weights, is_causal)


def inputs(batch, heads, lq, lk, d_k, d_v, dtype, strided=False):
    def make(n, d):
        if strided:  # (B, L, H, d) storage seen as (B, H, L, d), as the block's head split produces
            return torch.randn(batch, n, heads, d, device="cuda").transpose(1, 2).to(dtype)
        return torch.randn(batch, heads, n, d, device="cuda").to(dtype)

    return make(lq, d_k), make(lk, d_k), make(lk, d_v)


def mask_with_dead_rows(batch, lq, lk, dtype):
    mask = (torch.rand(batch, 1, lq, lk, device="cuda") > 0.3).to(dtype)
    mask[:, :, 1] = 0  # row 1 masked everywhere: uniform weights over all keys
    return mask


def causal_and(mask, lq, lk):
    tril = torch.tril(torch.ones(lq, lk, dtype=torch.bool, device="cuda"))
    return tril if mask is None else (mask != 0) & tril


def reference(q, k, v, mask, grad_out, grad_weights=None, keep=None, p=0.0):
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    out, weights = oracle_attention(q64, k64, v64, mask, keep, p)
    loss = (out * grad_out.double()).sum()
    if grad_weights is not None:
        loss = loss + (weights * grad_weights.double()).sum()
    grads = torch.autograd.grad(loss, (q64, k64, v64))
    return out, weights, grads


def check(dtype, got, want, grads=False):
    tol = (GRAD_TOLERANCES if grads else TOLERANCES)[dtype]
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double() / scale, want.double() / scale, **tol)


@pytest.mark.sdpa
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_k,d_v", [(16, 16), (64, 64), (100, 72), (128, 128), (200, 256)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_forward_backward_match_oracle(dtype, d_k, d_v, need_weights):
    q, k, v = inputs(2, 3, 130, 97, d_k, d_v, dtype, strided=True)
    mask = mask_with_dead_rows(2, 130, 97, torch.float32)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, weights = attention(q, k, v, mask, need_weights=need_weights)
    grad_out = torch.randn_like(out)
    grad_weights = torch.randn_like(weights) if need_weights else None
    ref_out, ref_weights, ref_grads = reference(q, k, v, mask, grad_out, grad_weights)
    check(dtype, out, ref_out)
    if need_weights:
        check(dtype, weights, ref_weights)
        grads = torch.autograd.grad((out, weights), (q, k, v), (grad_out, grad_weights))
    else:
        assert weights.numel() == 0
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    for got, want in zip(grads, ref_grads):
        check(dtype, got, want, grads=True)


@pytest.mark.sdpa
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 300), (63, 64), (65, 65), (300, 1), (257, 511)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_causal_with_padding_matches_oracle(dtype, lq, lk, need_weights):
    q, k, v = inputs(2, 2, lq, lk, 64, 64, dtype)
    padding = torch.ones(2, 1, 1, lk, dtype=torch.bool, device="cuda")
    padding[0, ..., : min(lk, 70)] = False  # the first rows' causal windows are masked everywhere
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, _ = attention(q, k, v, padding, need_weights=need_weights, is_causal=True)
    grad_out = torch.randn_like(out)
    ref_out, _, ref_grads = reference(q, k, v, causal_and(padding, lq, lk), grad_out)
    check(dtype, out, ref_out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), ref_grads):
        check(dtype, got, want, grads=True)


def padded_mask(kind, lengths, length):
    """Padded batches: sentences of `lengths` tokens padded to `length`, as int64 masks. "keys": (B, 1, 1, L) key
    padding; "decoder": (B, 1, L, L) key padding and the causal triangle; "left": (B, 1, 1, L) keeping the last
    `lengths` keys (with is_causal, the rows before a sentence's first key see none)."""
    keys = torch.arange(length, device="cuda")
    lengths = torch.tensor(lengths, device="cuda").view(-1, 1, 1, 1)
    if kind == "left":
        return (keys >= length - lengths).long()
    padding = (keys < lengths).long()
    return padding if kind == "keys" else padding * torch.tril(torch.ones(length, length, device="cuda")).long()


@pytest.mark.sdpa
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind,is_causal", [("keys", False), ("decoder", False), ("left", True)])
def test_padded_batches_match_oracle(kernel_mode, dtype, d, kind, is_causal):
    # The flash kernels skip the tiles of scores that no row of a tile sees (here most of them).
    q, k, v = inputs(3, 2, 350, 350, d, d, dtype, strided=True)
    mask = padded_mask(kind, [27, 64, 300], 350)
    if kernel_mode == "sdpa-switches":  # the switch's kernel runs these calls (not a silent fallback)
        explanation = fastmha.explain(q, k, v, mask, 0.0, False, is_causal)
        assert explanation.count("torch-cuda-sdpa") == 2, explanation
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, _ = attention(q, k, v, mask, need_weights=False, is_causal=is_causal)
    grad_out = torch.randn_like(out)
    ref_out, _, ref_grads = reference(q, k, v, causal_and(mask, 350, 350) if is_causal else mask, grad_out)
    check(dtype, out, ref_out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), ref_grads):
        check(dtype, got, want, grads=True)


@pytest.mark.sdpa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where,value", [("v", float("nan")), ("k", float("inf")), ("q", float("inf"))])
@pytest.mark.parametrize("is_causal", [False, True])
def test_nan_behind_skipped_tiles_propagates_like_the_oracle(kernel_mode, dtype, where, value, is_causal):
    # A hidden key's zero weight times a NaN value is NaN in the math, and so is its zero score gradient times an
    # infinite key or query: heads that hold one skip no tile. Head 1 stays finite.
    q, k, v = inputs(1, 2, 100, 300, 64, 64, dtype)
    mask = padded_mask("keys", [50], 300)
    {"q": q, "k": k, "v": v}[where][0, 0, 200 if where != "q" else 70, 5] = value
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, _ = attention(q, k, v, mask, need_weights=False, is_causal=is_causal)
    grad_out = torch.randn_like(out)
    ref_out, _, ref_grads = reference(q, k, v, causal_and(mask, 100, 300) if is_causal else mask, grad_out)
    # With FASTMHA_CUDA_MASKED=sdpa torch's kernel adds the mask as a -inf bias: a non-finite score at a hidden key
    # (an infinite key or query) turns its row NaN where the contract's -1e9 keeps it finite, and the backward
    # spreads that over the head (the switch's documented deviation). There NaN may spread, never vanish.
    spreads = kernel_mode == "sdpa-switches" and where in ("k", "q")
    for got, want in zip((out, *torch.autograd.grad(out, (q, k, v), grad_out)), (ref_out, *ref_grads)):
        if spreads:
            assert (got.isnan() | ~want.isnan()).all()
        else:
            assert torch.equal(got.isnan().cpu(), want.isnan().cpu())
        assert want[:, 1].isfinite().all()
        check(dtype, got[:, 1], want[:, 1], grads=got is not out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_k,d_v", [(64, 64), (128, 128), (96, 64)])
@pytest.mark.parametrize("lq,lk,is_causal", [(200, 200, False), (200, 200, True), (77, 333, False), (333, 77, True)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_unmasked_calls_match_oracle(dtype, d_k, d_v, lq, lk, is_causal, need_weights):
    # Without a mask SDPA may pick cuDNN; causality with Lq != Lk goes to another kernel (top-left alignment).
    q, k, v = inputs(2, 3, lq, lk, d_k, d_v, dtype, strided=True)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, _ = attention(q, k, v, need_weights=need_weights, is_causal=is_causal)
    grad_out = torch.randn_like(out)
    ref_out, _, ref_grads = reference(q, k, v, causal_and(None, lq, lk) if is_causal else None, grad_out)
    check(dtype, out, ref_out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), ref_grads):
        check(dtype, got, want, grads=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_auto_runs_a_fused_kernel_wherever_sdpa_does_without_a_mask(kernel_mode, is_causal):
    # The layer must not leave SDPA's fast path for the ATen composite (cuDNN included, as SDPA picks it on Hopper).
    if kernel_mode != "auto":
        pytest.skip("the choice of FASTMHA_CUDA_KERNELS=auto")
    q, k, v = inputs(2, 4, 256, 256, 64, 64, torch.bfloat16)
    if torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal) == 0:
        pytest.skip("SDPA itself runs its math kernel here")
    explanation = fastmha.explain(q, k, v, None, 0.0, False, is_causal)
    assert explanation.count("torch-cuda-sdpa") == 2, explanation


@pytest.mark.sdpa
@pytest.mark.parametrize("dtype,default_kernel", [(torch.bfloat16, "fastmha-cuda"), (torch.float32, "aten-composite")])
def test_the_choice_for_masked_calls(kernel_mode, monkeypatch, dtype, default_kernel):
    # By default masked calls stay off torch's kernels: fastmha's flash kernels in half types, the composite in
    # float32. FASTMHA_CUDA_MASKED=sdpa sends them to SDPA's memory-efficient kernel from 64 keys on.
    if kernel_mode not in ("auto", "sdpa-switches"):
        pytest.skip("the choice of FASTMHA_CUDA_KERNELS=auto")
    q, k, v = inputs(2, 4, 256, 256, 64, 64, dtype)
    mask = torch.rand(2, 1, 1, 256, device="cuda") > 0.2
    explanation = fastmha.explain(q, k, v, mask, 0.0, False)
    if kernel_mode == "auto":
        assert explanation.count(default_kernel) == 2, explanation
        return
    assert explanation.count("torch-cuda-sdpa") == 2 and "memory-efficient" in explanation, explanation
    few_keys = fastmha.explain(q, k[:, :, :10], v[:, :, :10], mask[..., :10], 0.0, False)
    assert "torch-cuda-sdpa" not in few_keys, few_keys  # below the memory-efficient kernel's key tile
    for switch in ("FASTMHA_CUDA_MASKED", "FASTMHA_CUDA_DROPOUT"):
        monkeypatch.setenv(switch, "always")
        with pytest.raises(RuntimeError, match=f"{switch} must be auto or sdpa, got 'always'"):
            attention(q, k, v, mask)
        monkeypatch.setenv(switch, "sdpa")


@pytest.mark.sdpa
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_calls_are_captured_by_cuda_graphs(dtype):
    # Nothing on a masked call's path reads a value back to the host (the layer finds the rows with no visible key
    # on the device), so a graph captures it, and its replays follow new inputs.
    q, k, v = inputs(2, 2, 150, 150, 64, 64, dtype)
    mask = padded_mask("decoder", [30, 150], 150)
    mask[0, 0, 7] = 0  # a row with no visible key
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention(q, k, v, mask)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, _ = attention(q, k, v, mask)
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        check(dtype, static_out, reference(q, k, v, mask, torch.zeros_like(static_out))[0])


@pytest.mark.parametrize("dtype,d,variant,mma", [
    (torch.bfloat16, 64, "mma", True), (torch.float16, 128, "mma16", True), (torch.bfloat16, 200, "mma", False),
    (torch.float32, 64, "mma", False)])
def test_the_flash_switch_names_the_kernels_that_run(kernel_mode, monkeypatch, dtype, d, variant, mma):
    if kernel_mode != "own":
        pytest.skip("the flash kernels of FASTMHA_CUDA_KERNELS=own")
    monkeypatch.setenv("FASTMHA_CUDA_FLASH", variant)
    q, k, v = inputs(1, 2, 100, 100, d, d, dtype)
    for line, pass_name in zip(fastmha.explain(q, k, v, None, 0.0, False).splitlines(), ("forward", "backward")):
        assert line.startswith(pass_name + " fastmha-cuda"), line
        if mma:
            assert f"{pass_name}: the mma kernel (FASTMHA_CUDA_FLASH={variant})" in line, line
        else:
            assert "the wmma kernels (the mma kernels take float16/bfloat16 with head sizes up to 128)" in line, line
    monkeypatch.setenv("FASTMHA_CUDA_FLASH", "fast")
    with pytest.raises(RuntimeError, match="FASTMHA_CUDA_FLASH must be auto, wmma, mma or mma16, got 'fast'"):
        attention(q, k, v)


@pytest.mark.sdpa
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.int64, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(97,), (1, 97), (2, 1, 1, 97), (3, 130, 97), (2, 3, 130, 97)])
def test_mask_shapes_and_dtypes(mask_dtype, shape):
    q, k, v = inputs(2, 3, 130, 97, 32, 32, torch.float32)
    mask = (torch.rand(shape, device="cuda") > 0.4).to(mask_dtype)
    for need_weights in (False, True):
        out, _ = attention(q, k, v, mask, need_weights=need_weights)
        check(torch.float32, out, reference(q, k, v, mask, torch.zeros_like(out))[0])


def keep_mask_of(q, k, v, mask, p, is_causal, seed):
    """Which weights the dropout kept, read off the weights-kept path (softmax weights are never exactly 0)."""
    torch.manual_seed(seed)
    _, weights = attention(q, k, v, mask, p, need_weights=True, is_causal=is_causal)
    return weights != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_is_reproducible_shared_by_both_paths_and_replayed_by_backward(dtype, is_causal):
    # (Not in the sdpa-switches mode, whose dropout draws torch's masks: see the next test.)
    p = 0.3
    q, k, v = inputs(2, 2, 150, 150, 64, 64, dtype)
    mask = mask_with_dead_rows(2, 150, 150, torch.bool)
    full_mask = causal_and(mask, 150, 150) if is_causal else mask
    keep = keep_mask_of(q, k, v, mask, p, is_causal, seed=11)
    # Masked scores have weight exactly 0 whether kept or not; the oracle gives them no gradient either.
    assert 0.6 < keep[full_mask.expand_as(keep) != 0].float().mean().item() < 0.8
    assert torch.equal(keep, keep_mask_of(q, k, v, mask, p, is_causal, seed=11))  # same seed, same mask
    assert not torch.equal(keep, keep_mask_of(q, k, v, mask, p, is_causal, seed=12))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    torch.manual_seed(11)
    out, _ = attention(q, k, v, mask, p, need_weights=False, is_causal=is_causal)  # the flash path
    grad_out = torch.randn_like(out)
    ref_out, _, ref_grads = reference(q, k, v, full_mask, grad_out, keep=keep, p=p)
    check(dtype, out, ref_out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), ref_grads):
        check(dtype, got, want, grads=True)


def check_output_and_grads(dtype, out, q, k, v, mask, keep, p):
    """out, a call's output of q, k, v (which require grad), and its gradients against the oracle's with this
    dropout keep-mask."""
    grad_out = torch.randn_like(out)
    ref_out, _, ref_grads = reference(q, k, v, mask, grad_out, keep=keep, p=p)
    check(dtype, out, ref_out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), ref_grads):
        check(dtype, got, want, grads=True)


def identity_first_values(batch, heads, lk, d, dtype):
    """V whose first lk columns are the identity: the output's first lk columns are then the applied weights."""
    eye = torch.eye(lk, device="cuda").expand(batch, heads, lk, lk)
    return torch.cat([eye, torch.randn(batch, heads, lk, d - lk, device="cuda")], dim=-1).to(dtype)


@pytest.mark.sdpa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked,is_causal", [(False, False), (True, False), (True, True)])
def test_dropout_on_sdpa_is_reproducible_and_replayed_by_backward(kernel_mode, dtype, masked, is_causal):
    # FASTMHA_CUDA_DROPOUT=sdpa: torch's memory-efficient kernel draws its own masks. The first 64 columns of V are
    # the identity, so the output's first 64 columns are the dropped-out weights themselves: the mask is read off
    # the output, and the backward must replay it.
    if kernel_mode != "sdpa-switches":
        pytest.skip("the dropout of FASTMHA_CUDA_DROPOUT=sdpa")
    p, lq, lk = 0.3, 100, 64
    q, k, _ = inputs(2, 2, lq, lk, 128, 128, dtype)
    v = identity_first_values(2, 2, lk, 128, dtype)
    mask = mask_with_dead_rows(2, lq, lk, torch.bool) if masked else None
    full_mask = causal_and(mask, lq, lk) if is_causal else mask
    explanation = fastmha.explain(q, k, v, mask, p, False, is_causal)
    assert explanation.count("torch-cuda-sdpa") == 2 and "FASTMHA_CUDA_DROPOUT=sdpa" in explanation, explanation

    def run(seed):
        torch.manual_seed(seed)
        return attention(q, k, v, mask, p, is_causal=is_causal)[0]

    first = run(11)
    assert torch.equal(first, run(11))  # same seed, same mask
    assert not torch.equal(first, run(12))
    keep = first[..., :lk] != 0  # weights are never exactly 0 except where the mask hides a key
    visible = torch.ones_like(keep) if full_mask is None else (full_mask != 0).expand_as(keep)
    dead = ~visible.any(-1, keepdim=True)
    assert 0.6 < keep[visible | dead].float().mean().item() < 0.8
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    torch.manual_seed(11)
    out, _ = attention(q, k, v, mask, p, is_causal=is_causal)
    check_output_and_grads(dtype, out, q, k, v, full_mask, keep, p)


@pytest.mark.sdpa
@pytest.mark.parametrize("forward_in", ["weights kept", "math only"])
def test_a_backward_replays_fastmha_draw_under_the_dropout_switch(kernel_mode, forward_in):
    # With FASTMHA_CUDA_DROPOUT=sdpa a forward still draws fastmha's stream where it keeps its weights or where torch's
    # memory-efficient kernel is disabled; its backward (no weight gradient; outside that setting) must replay that
    # stream, not hand it to torch's kernel.
    if kernel_mode != "sdpa-switches":
        pytest.skip("the dropout of FASTMHA_CUDA_DROPOUT=sdpa")
    p, dtype = 0.3, torch.bfloat16
    q, k, v = inputs(2, 2, 100, 96, 64, 64, dtype)
    mask = mask_with_dead_rows(2, 100, 96, torch.bool)
    keep = keep_mask_of(q, k, v, mask, p, False, seed=7)  # fastmha's stream, read off the kept weights
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    torch.manual_seed(7)
    if forward_in == "weights kept":
        out, _ = attention(q, k, v, mask, p, need_weights=True)  # the loss reads the output only
    else:
        with sdpa_kernel(SDPBackend.MATH):
            out, _ = attention(q, k, v, mask, p)
    check_output_and_grads(dtype, out, q, k, v, mask, keep, p)


@pytest.mark.sdpa
def test_torch_draw_is_replayed_where_its_kernel_is_disabled_and_refused_to_double_backward(kernel_mode):
    if kernel_mode != "sdpa-switches":
        pytest.skip("the dropout of FASTMHA_CUDA_DROPOUT=sdpa")
    p, lk, dtype = 0.3, 64, torch.bfloat16
    q, k, _ = inputs(2, 2, 100, lk, 128, 128, dtype)
    v = identity_first_values(2, 2, lk, 128, dtype)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    assert fastmha.explain(q, k, v, None, p, False).startswith("forward torch-cuda-sdpa")
    out, _ = attention(q, k, v, None, p)  # torch's draw
    keep = out.detach()[..., :lk] != 0
    grad_out = torch.randn_like(out)
    ref_out, _, ref_grads = reference(q, k, v, None, grad_out, keep=keep, p=p)
    with sdpa_kernel(SDPBackend.MATH):  # the backward still replays torch's draw on torch's kernel
        grads = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    for got, want in zip(grads, ref_grads):
        check(dtype, got, want, grads=True)
    with pytest.raises(RuntimeError, match="FASTMHA_CUDA_DROPOUT=sdpa"):
        torch.autograd.grad(out, q, grad_out, create_graph=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [701, 1500, 2048, 4098, 9000])
def test_weights_kept_long_rows_match_oracle(kernel_mode, dtype, lk):
    # The row kernels hold a row in registers over two warps (up to 1024 keys) and eight (up to 8192), and give
    # longer rows a block each; Lk % 4 != 0 takes scalar loads instead of vector ones.
    if kernel_mode != "auto":
        pytest.skip("the weights-kept path is the same in every kernel mode")
    p = 0.1
    q, k, v = inputs(1, 2, 33, lk, 64, 64, dtype, strided=True)
    mask = mask_with_dead_rows(1, 33, lk, torch.bool)
    keep = keep_mask_of(q, k, v, mask, p, False, seed=5)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    torch.manual_seed(5)
    out, weights = attention(q, k, v, mask, p, need_weights=True)
    grad_out, grad_weights = torch.randn_like(out), torch.randn_like(weights)
    ref_out, ref_weights, ref_grads = reference(q, k, v, mask, grad_out, grad_weights, keep=keep, p=p)
    check(dtype, out, ref_out)
    check(dtype, weights, ref_weights)
    for got, want in zip(torch.autograd.grad((out, weights), (q, k, v), (grad_out, grad_weights)), ref_grads):
        check(dtype, got, want, grads=True)


@pytest.mark.sdpa
@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_float64(need_weights):
    q, k, v = (x.requires_grad_(True) for x in inputs(1, 2, 9, 13, 5, 7, torch.float64))
    mask = mask_with_dead_rows(1, 9, 13, torch.bool)
    for is_causal in (False, True):
        assert gradcheck(lambda q, k, v: attention(q, k, v, mask, 0.0, need_weights, is_causal)[0], (q, k, v))


def test_head_sizes_above_256_fall_back_and_stay_correct():
    q, k, v = inputs(1, 2, 20, 30, 300, 260, torch.float32)
    out, _ = attention(q, k, v)
    check(torch.float32, out, reference(q, k, v, None, torch.zeros_like(out))[0])


def test_empty_inputs():
    q, k, v = inputs(2, 3, 0, 5, 16, 16, torch.float16)
    out, weights = attention(q, k, v, need_weights=True)
    assert out.shape == (2, 3, 0, 16) and weights.shape == (2, 3, 0, 5)


def test_side_stream_and_inputs_unchanged():
    q, k, v = inputs(2, 4, 200, 200, 64, 64, torch.bfloat16, strided=True)
    copies = [x.clone() for x in (q, k, v)]
    expected, _ = attention(q, k, v, is_causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, _ = attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)
    for x, copy in zip((q, k, v), copies):
        assert torch.equal(x, copy)


@pytest.mark.sdpa
def test_cuda_graph_capture_with_dropout():
    # Each replay must draw fresh dropout (the Philox offset is read on the device), like eager calls do.
    q, k, v = inputs(1, 2, 128, 128, 64, 64, torch.float16)
    static_out = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention(q, k, v, None, 0.5)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, _ = attention(q, k, v, None, 0.5)
    graph.replay()
    first = static_out.clone()
    graph.replay()
    assert torch.isfinite(first).all()
    assert not torch.equal(first, static_out)


def test_block_on_cuda_matches_cpu():
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(256, 4, 0.0)
    x = torch.randn(2, 77, 256)
    mask = torch.ones(2, 1, 1, 77, dtype=torch.bool)
    mask[1, ..., 60:] = False
    expected = block(x, x, x, mask)
    expected_scores = block.attention_scores.clone()
    got = block.cuda()(x.cuda(), x.cuda(), x.cuda(), mask.cuda())
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(block.attention_scores.cpu(), expected_scores, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("where,value", [("k", float("nan")), ("v", float("nan")), ("q", float("inf")),
                                         ("q", -float("inf")), ("q", 1e30)])
def test_nan_and_inf_propagate_like_the_oracle(need_weights, where, value):
    q, k, v = (x.cpu() for x in inputs(1, 2, 4, 6, 8, 8, torch.float64))
    {"q": q, "k": k, "v": v}[where][0, 0, 3 if where != "q" else 1, 0] = value
    mask = torch.ones(6, dtype=torch.bool)
    mask[3] = False  # NaN keys under the mask never reach the scores; NaN values still meet 0 * NaN
    ref_out, _ = oracle_attention(q, k, v, mask)
    out, _ = attention(q.cuda(), k.cuda(), v.cuda(), mask.cuda(), need_weights=need_weights)
    torch.testing.assert_close(out.cpu(), ref_out, equal_nan=True)


@pytest.mark.sdpa
def test_our_kernels_agree_with_the_aten_path(tmp_path, kernel_mode):
    # The same calls in a process with FASTMHA_CUDA_KERNELS=aten (the ATen composite).
    script = tmp_path / "calls.py"
    script.write_text(
        "import sys, torch, fastmha\n"
        "torch.manual_seed(3)\n"
        "q, k, v = (torch.randn(2, 4, 300, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True) "
        "for _ in range(3))\n"
        "mask = torch.rand(2, 1, 1, 300, device='cuda') > 0.2\n"
        "results = []\n"
        "for need_weights in (False, True):\n"
        "    for is_causal in (False, True):\n"
        "        out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, need_weights, is_causal)\n"
        "        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))\n"
        "        results += [out.detach().cpu(), *(g.cpu() for g in grads)]\n"
        "torch.save(results, sys.argv[1])\n")
    ours, aten = tmp_path / "ours.pt", tmp_path / "aten.pt"
    env = dict(os.environ)  # the mode's switches, set by the kernel_mode fixture
    subprocess.run([sys.executable, str(script), str(ours)], check=True, env=env, timeout=300)
    env["FASTMHA_CUDA_KERNELS"] = "aten"
    subprocess.run([sys.executable, str(script), str(aten)], check=True, env=env, timeout=300)
    for got, want in zip(torch.load(ours), torch.load(aten)):
        check(torch.bfloat16, got, want, grads=True)
