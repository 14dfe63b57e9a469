"""The kernel choice (ops/kernel_choice.cpp) and the contract layer over torch's own kernels (ops/stock/).

The choice is tested as a function (fastmha.explain), and each kernel is forced with FASTMHA_CPU_KERNELS and
checked against the oracle, including the parts of the contract the stock kernel does not have by itself:
masks of any dtype and broadcast shape, rows with no visible key (uniform over all keys), top-left causal.
A forward and its backward may run on different kernels (the saved log-sum-exp means the same for both).
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_close, torch_on_tiles
from layouts import RELAYOUTS, relaid
from oracle import oracle_attention
from torch.autograd import gradcheck

import fastmha


@pytest.fixture(autouse=True)
def products_on_the_blas(monkeypatch):
    """The choice of kernel, not of the float32 GEMM under it (test_float_products.py): no products note."""
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "blas")


def qkv(b=2, h=3, lq=9, lk=11, d=8, dtype=torch.float64, dv=None, requires_grad=False):
    shapes = [(b, h, lq, d), (b, h, lk, d), (b, h, lk, dv or d)]
    return [torch.randn(s, dtype=dtype, requires_grad=requires_grad) for s in shapes]


def choices(*args, **kwargs):
    """{"forward": (kernel, reason), "backward": (kernel, reason)} from fastmha.explain."""
    lines = fastmha.explain(*args, **kwargs).splitlines()
    assert [line.split()[0] for line in lines] == ["forward", "backward"]
    return {line.split()[0]: tuple(line.split(" ", 1)[1].split(": ", 1)) for line in lines}


def kernel_of(*args, **kwargs):
    """The kernel of a call whose forward and backward run on the same one."""
    chosen = choices(*args, **kwargs)
    assert chosen["forward"][0] == chosen["backward"][0], chosen
    return chosen["forward"][0]


# ---- the choice itself ----


def test_kept_weights_and_dropout_run_fastmhas_kernel():
    q, k, v = qkv(dtype=torch.bfloat16)
    # The backward of a loss that does not read bfloat16 weights may be torch's (where its kernels use AMX tiles).
    assert choices(q, k, v, need_weights=True)["forward"][0] == "fastmha-cpu"
    assert kernel_of(*qkv(dtype=torch.float32), need_weights=True) == "fastmha-cpu"
    assert kernel_of(q, k, v, dropout_p=0.1, need_weights=False) == "fastmha-cpu"
    assert "dropout" in fastmha.explain(q, k, v, dropout_p=0.1, need_weights=False)


def test_backward_with_dropout_says_when_it_reads_the_kept_weights():
    # Up to dropout 0.1 a float32 backward takes the softmax from the weights its forward kept.
    reads = "fastmha's kernel takes the softmax from the kept weights"
    q, k, v = qkv(dtype=torch.float32)
    assert reads in choices(q, k, v, dropout_p=0.1, need_weights=True)["backward"][1]
    plain = ("fastmha-cpu", "dropout: torch's CPU flash kernel has none")
    for p, need_weights in ((0.2, True), (0.1, False)):
        assert choices(q, k, v, dropout_p=p, need_weights=need_weights)["backward"] == plain, (p, need_weights)
    # Not in float64 (recomputing the dropped weights costs more there), nor in a half type (too coarse).
    for dtype in (torch.float64, torch.bfloat16):
        q, k, v = qkv(dtype=dtype)
        assert reads not in choices(q, k, v, dropout_p=0.1, need_weights=True)["backward"][1], dtype
    # Without dropout float64 reads them too.
    q, k, v = qkv(dtype=torch.float64)
    assert "softmax from them" in choices(q, k, v, need_weights=True)["backward"][1]


def test_forward_without_weights_runs_fastmhas_kernel_up_to_512_keys_and_torchs_beyond():
    for dtype in (torch.float64, torch.float32):
        for lk in (11, 512):
            q, k, v = qkv(b=1, h=1, lk=lk, dtype=dtype)
            assert choices(q, k, v, need_weights=False)["forward"] == (
                "fastmha-cpu", "forward over at most 512 keys: fastmha's kernel is as fast as torch's or faster there")
        # float64 beyond 512 keys runs torch's kernel, whatever the query rows (float32 on AVX-512: below).
        if dtype == torch.float64:
            for lq in (1, 300):  # a decoding step, a block of queries
                q, k, v = qkv(b=1, h=1, lq=lq, lk=513, dtype=dtype)
                assert choices(q, k, v, need_weights=False)["forward"][0] == "torch-cpu-flash", lq


@pytest.mark.parametrize("float_gemm", ["blas", "brgemm"])
def test_float32_forward_runs_fastmhas_kernel_beyond_512_keys_on_avx512(monkeypatch, float_gemm):
    # Where fastmha's kernels run AVX-512 (their own polynomial exp, a single query row on vector loops) its float32
    # forward takes longer rows too, whatever the query rows and wherever its P V runs (the BLAS or oneDNN's brgemm);
    # float64 (no such exp) stays with torch's.
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", float_gemm)
    avx512 = fastmha._C.cpu_capability() == "avx512"
    for dtype, lq in ((torch.float32, 1), (torch.float32, 3), (torch.float32, 255), (torch.float32, 256),
                      (torch.float64, 1), (torch.float64, 256)):
        own = avx512 and dtype == torch.float32
        q, k, v = qkv(b=1, h=1, lq=lq, lk=600, dtype=dtype)
        kernel, reason = choices(q, k, v, need_weights=False)["forward"]
        assert kernel == ("fastmha-cpu" if own else "torch-cpu-flash"), (dtype, lq, reason)
        if own:
            assert reason.startswith("float32 forward on AVX-512: fastmha's kernel is faster than torch's beyond 512 "
                                     "keys too"), reason
        out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
        want = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8**0.5, -1) @ v.double()
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_causal_forward_without_weights_runs_fastmhas_kernel():
    for dtype in (torch.float64, torch.float32):
        q, k, v = qkv(dtype=dtype)
        kernel, reason = choices(q, k, v, need_weights=False, is_causal=True)["forward"]
        assert (kernel, reason) == ("fastmha-cpu", "is_causal: fastmha's kernel skips the keys above the diagonal "
                                                   "chunk by chunk of queries, faster than torch's")
        assert choices(q, k, v, need_weights=False, is_causal=True)["backward"][0] == "fastmha-cpu"
    for dtype, on_tiles in torch_on_tiles().items():
        if dtype in (torch.bfloat16, torch.float16):
            q, k, v = qkv(dtype=dtype)
            kernel = choices(q, k, v, need_weights=False, is_causal=True)["forward"][0]
            assert kernel == ("torch-cpu-flash" if on_tiles else "fastmha-cpu"), dtype


def test_bfloat16_forward_with_heads_of_64_or_128_on_amx_tiles_runs_fastmhas_native_products(monkeypatch):
    # Where torch multiplies bfloat16 on AMX tiles, fastmha's forward takes over for head sizes of 64 and 128 when its
    # own products run natively too (256 query rows or more, or 128-255 in chunks of 128 or more), with or without
    # is_causal; torch's keeps the rest.
    if not torch_on_tiles()[torch.bfloat16]:
        pytest.skip("torch multiplies bfloat16 without AMX tiles here: fastmha's forward runs at any head size")
    with monkeypatch.context() as patch:
        patch.setenv("FASTMHA_CPU_HALF_GEMM", "native")
        q = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)
        if "own instructions" not in fastmha.explain(q, q, q, None, 0.0, True).splitlines()[0]:
            pytest.skip("fastmha multiplies bfloat16 widened here")
    # Below 256 rows the chunks count: 64 heads on 2 threads keep one chunk per head (192 rows: one chunk, its
    # products in row blocks of 128 + 64), one head is cut into chunks of 32 rows.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for heads, lq, d, is_causal, expected in (
                (1, 256, 64, False, "fastmha-cpu"), (1, 300, 64, True, "fastmha-cpu"),
                (1, 256, 128, False, "fastmha-cpu"), (1, 256, 128, True, "fastmha-cpu"),
                (1, 256, 96, False, "torch-cpu-flash"), (64, 128, 128, False, "fastmha-cpu"),
                (64, 127, 128, False, "torch-cpu-flash"), (64, 255, 64, False, "fastmha-cpu"),
                (64, 128, 64, False, "fastmha-cpu"), (64, 192, 64, False, "fastmha-cpu"),
                (64, 127, 64, False, "torch-cpu-flash"), (1, 128, 64, False, "torch-cpu-flash")):
            q, k, v = qkv(b=heads, h=1, lq=lq, lk=lq, d=d, dtype=torch.bfloat16)
            kernel, reason = choices(q, k, v, need_weights=False, is_causal=is_causal)["forward"]
            assert kernel == expected, (heads, lq, d, is_causal, reason)
            if expected == "fastmha-cpu":
                assert reason.startswith(f"bfloat16 forward with a head size of {d} in native products"), reason
    finally:
        torch.set_num_threads(threads)


def test_lowered_cpu_capability_keeps_half_types_off_torchs_tiles():
    # Below AVX512 (ATEN_CPU_CAPABILITY=avx2) torch's flash kernel still asks whether to pack bfloat16 for AMX tiles,
    # then fails to ("pack_vnni2 is only supported when avx512 is supported"): such calls run fastmha's kernel.
    code = """
import torch, fastmha
q = torch.randn(2, 4, 64, 16, dtype=torch.bfloat16, requires_grad=True)
mask = torch.ones(2, 1, 1, 64, dtype=torch.bool)
mask[..., 40:] = False
print(fastmha.explain(q, q, q, mask, 0.0, False))
out = torch.ops.fastmha.attention(q, q, q, mask, 0.0, False, False)[0]
out.sum().backward()
print(bool(torch.isfinite(out).all() and torch.isfinite(q.grad).all()))
"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("forward fastmha-cpu") and lines[1].startswith("backward fastmha-cpu"), lines
    assert lines[-1] == "True"


@pytest.mark.parametrize("dtype,name", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")])
def test_half_type_forward_runs_torchs_kernel_only_on_amx_tiles(dtype, name):
    q, k, v = qkv(dtype=dtype)
    kernel, reason = choices(q, k, v, need_weights=False)["forward"]
    if torch_on_tiles()[dtype]:
        assert kernel == "torch-cpu-flash"
    else:
        assert (kernel, reason.split(";")[0]) == (
            "fastmha-cpu", f"{name} forward without AMX tiles for {name} in torch's CPU flash kernel: fastmha's "
            "kernel is as fast or faster")


@pytest.mark.parametrize("lk", [600, 8192])  # above the 512 keys up to which fastmha's forward runs anyway
def test_float32_forward_skips_padding_up_to_three_quarters_of_the_keys_at_any_length(lk):
    # Past that share float32 runs torch's kernel, except on AVX-512, where fastmha's runs it anyway.
    q, k, v = qkv(b=1, h=1, lq=4, lk=lk, dtype=torch.float32)
    avx512 = fastmha._C.cpu_capability() == "avx512"
    for share, expected in ((0.7, "fastmha-cpu"), (0.8, "fastmha-cpu" if avx512 else "torch-cpu-flash")):
        mask = (torch.arange(lk) < int(share * lk)).reshape(1, 1, 1, lk)
        kernel, reason = choices(q, k, v, mask, need_weights=False)["forward"]
        assert kernel == expected, (share, reason)
        skips = reason.startswith(f"a mask that leaves {round(share * 100)}% of the keys")
        assert skips == (share == 0.7), reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_type_padding_share_that_pays_depends_on_amx_tiles_and_native_products(monkeypatch, dtype):
    # 256 query rows over 2048 keys: enough of both for native products wherever the CPU has them.
    monkeypatch.delenv("FASTMHA_CPU_HALF_GEMM", raising=False)
    q, k, v = qkv(b=1, h=1, lq=256, lk=2048, dtype=dtype)

    def kernels(share):
        mask = (torch.arange(2048) < int(share * 2048)).reshape(1, 1, 1, 2048)
        chosen = choices(q, k, v, mask, need_weights=False)
        return chosen["forward"][0], chosen["backward"][0]

    own, stock = "fastmha-cpu", "torch-cpu-flash"
    if not torch_on_tiles()[dtype]:  # torch's half-type kernels are slow there: fastmha's at any share
        assert kernels(0.15) == kernels(0.9) == (own, own)
        return
    # Native products (AMX too): forward and backward pay up to 75% of the keys.
    assert kernels(0.7) == (own, own)
    assert kernels(0.8) == (stock, stock)
    # Widened products pay only below 20%.
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "widen")
    assert kernels(0.15) == (own, own)
    assert kernels(0.3) == (stock, stock)


@pytest.mark.parametrize("lk", [11, 512, 513])
def test_backward_kernel_depends_on_amx_tiles_for_half_types_beyond_512_keys(lk):
    for dtype, on_tiles in torch_on_tiles().items():
        q, k, v = qkv(b=1, h=1, lq=129, lk=lk, dtype=dtype)
        expected = "torch-cpu-flash" if on_tiles and lk > 512 else "fastmha-cpu"
        # Half-type weights are never handed to the backward, so keeping them changes nothing there.
        for need_weights in (False, True):
            kernel, reason = choices(q, k, v, need_weights=need_weights)["backward"]
            assert kernel == expected, (dtype, need_weights, reason)
            if on_tiles:
                assert reason.split(";")[0] == (
                    "backward in a half type torch's CPU flash kernel multiplies on AMX tiles, over more than 512 keys"
                    if lk > 512 else
                    "backward over at most 512 keys: fastmha's kernel is faster than torch's there, also on AMX tiles")


def test_half_backward_with_heads_of_64_or_128_in_native_products_stays_with_fastmha_beyond_512_keys():
    # On AMX tiles torch's backward takes over beyond 512 keys, except for heads of 64 or 128 whose products fastmha
    # runs natively (128 query rows or more in a backward on AMX tiles).
    if not torch_on_tiles()[torch.bfloat16]:
        pytest.skip("torch multiplies bfloat16 without AMX tiles here")
    q = torch.randn(1, 1, 256, 64, dtype=torch.bfloat16)
    if "own instructions" not in fastmha.explain(q, q, q, None, 0.0, False).splitlines()[1]:
        pytest.skip("fastmha's backward multiplies bfloat16 widened here")
    cases = ((256, 64, "fastmha-cpu"), (256, 128, "fastmha-cpu"), (256, 96, "torch-cpu-flash"),
             (129, 64, "fastmha-cpu"), (129, 128, "fastmha-cpu"), (129, 96, "torch-cpu-flash"))
    for lq, d, expected in cases:
        q, k, v = qkv(b=1, h=1, lq=lq, lk=600, d=d, dtype=torch.bfloat16)
        kernel, reason = choices(q, k, v, need_weights=False)["backward"]
        assert kernel == expected, (lq, d, reason)
        if expected == "fastmha-cpu":
            assert reason.startswith(f"bfloat16 backward with a head size of {d} in native products"), reason


def test_bfloat16_backward_with_few_query_rows_stays_with_fastmha_beyond_512_keys():
    # On AMX tiles torch's backward takes over beyond 512 keys, except with at most 128 query rows per head (any head
    # size, any products); float16 there is unmeasured and stays with torch's.
    on_tiles = torch_on_tiles()
    if not on_tiles[torch.bfloat16]:
        pytest.skip("torch multiplies bfloat16 without AMX tiles here")
    for lq, d, lk, expected in ((1, 8, 600, "fastmha-cpu"), (128, 96, 4096, "fastmha-cpu"),
                                (129, 96, 600, "torch-cpu-flash"), (128, 96, 512, "fastmha-cpu")):
        q, k, v = qkv(b=1, h=1, lq=lq, lk=lk, d=d, dtype=torch.bfloat16)
        kernel, reason = choices(q, k, v, need_weights=False)["backward"]
        assert kernel == expected, (lq, d, lk, reason)
        if lk > 512 and expected == "fastmha-cpu":
            assert reason.startswith("bfloat16 backward with at most 128 query rows per head"), reason
    if on_tiles[torch.float16]:
        q, k, v = qkv(b=1, h=1, lq=1, lk=600, dtype=torch.float16)
        assert choices(q, k, v, need_weights=False)["backward"][0] == "torch-cpu-flash"


def test_cases_torchs_kernel_cannot_serve_stay_with_fastmha(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "stock")
    q, k, v = qkv(dtype=torch.bfloat16, dv=16)
    assert "d_k != d_v" in fastmha.explain(q, k, v, need_weights=False)
    q, k, v = qkv(lq=0)
    assert kernel_of(q, k, v, need_weights=False) == "fastmha-cpu"


def test_switch_forces_a_kernel_and_rejects_unknown_values(monkeypatch):
    q, k, v = qkv(dtype=torch.bfloat16)
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "widen")
    widened = "bfloat16 products widened to float32"
    assert choices(q, k, v, need_weights=False) == {
        "forward": ("fastmha-cpu", f"FASTMHA_CPU_KERNELS=own; {widened} (FASTMHA_CPU_HALF_GEMM=widen)"),
        "backward": ("fastmha-cpu", f"FASTMHA_CPU_KERNELS=own; {widened} (FASTMHA_CPU_HALF_GEMM=widen)")}
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "fast")
    with pytest.raises(RuntimeError, match="FASTMHA_CPU_KERNELS must be auto, own or stock, got 'fast'"):
        fastmha.explain(q, k, v, need_weights=False)


def test_explain_checks_its_inputs():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="key"):
        fastmha.explain(q, k[..., :4], v)


def test_log_switch_prints_each_calls_choice(monkeypatch, capfd):
    monkeypatch.setenv("FASTMHA_LOG_KERNELS", "1")
    q, k, v = qkv(b=1, h=1, lk=600, dtype=torch.float64, requires_grad=True)
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
    out.sum().backward()
    err = capfd.readouterr().err
    assert "fastmha: forward Double" in err and "-> torch-cpu-flash" in err
    assert "fastmha: backward Double" in err


# ---- the contract layer, forced, against the oracle ----


def padding_mask(b, lk, dtype=torch.bool):
    mask = torch.ones(b, 1, 1, lk, dtype=dtype)
    mask[0, ..., -4:] = 0
    return mask


def mask_cases(lq, lk):
    rows = torch.rand(lq, lk) > 0.4
    rows[2] = False  # a row with no visible key
    whole_batch = padding_mask(2, lk)
    whole_batch[1] = False  # every row of batch 1
    return {
        "none": None,
        "padding bool": padding_mask(2, lk),
        "padding int": padding_mask(2, lk, torch.int64),
        "padding float": padding_mask(2, lk, torch.float32) * 0.5,  # only exact zeros mask
        "rows (Lq, Lk) with a dead row": rows,
        "whole batch masked": whole_batch,
        "per query (B, 1, Lq, 1)": (torch.arange(lq) % 3 != 0).reshape(1, 1, lq, 1).expand(2, 1, lq, 1),
    }


def causal_and(mask, lq, lk):
    causal = torch.ones(lq, lk, dtype=torch.bool).tril()
    return causal if mask is None else (mask != 0) & causal


@pytest.mark.parametrize("case", list(mask_cases(9, 11)))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(9, 11), (11, 9)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_stock_kernel_keeps_the_contract(monkeypatch, case, is_causal, lq, lk, dtype):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "stock")
    mask = mask_cases(lq, lk)[case]
    q, k, v = qkv(lq=lq, lk=lk, dtype=dtype, requires_grad=True)
    assert kernel_of(q, k, v, mask, need_weights=False, is_causal=is_causal) == "torch-cpu-flash"
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, is_causal)
    assert weights.numel() == 0 and out.is_contiguous()
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    full_mask = causal_and(mask, lq, lk) if is_causal else mask
    ref_out, _ = oracle_attention(*ref_inputs, full_mask)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad.double())
    assert_close(out, ref_out, dtype)
    for got, want in zip((dq, dk, dv), ref_grads):
        assert_close(got, want, dtype)


def test_stock_kernel_gradcheck_with_dead_rows(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "stock")
    q, k, v = qkv(b=2, h=2, lq=5, lk=6, d=4, requires_grad=True)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[1] = False
    mask[3, :2] = False

    def f(q, k, v):
        return torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, True)[0]

    assert gradcheck(f, (q, k, v))


@pytest.mark.parametrize("layout", RELAYOUTS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_stock_kernel_reads_any_layout(monkeypatch, layout, masked, is_causal):
    # torch's kernels assume a unit stride in the head dimension; the layer must hand them one.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "stock")
    base = qkv(lq=13, lk=7, d=5, dtype=torch.float32)
    q, k, v = (relaid(t, layout).requires_grad_() for t in base)
    mask = padding_mask(2, 7) if masked else None
    assert kernel_of(q, k, v, mask, need_weights=False, is_causal=is_causal) == "torch-cpu-flash"
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, is_causal)
    grad = relaid(torch.randn_like(out), layout)
    grads = torch.autograd.grad(out, (q, k, v), grad)

    ref_inputs = [t.detach().double().requires_grad_() for t in base]
    full_mask = causal_and(mask, 13, 7) if is_causal else mask
    ref_out, _ = oracle_attention(*ref_inputs, full_mask)
    assert_close(out, ref_out, torch.float32)
    for got, want in zip(grads, torch.autograd.grad(ref_out, ref_inputs, grad.double())):
        assert_close(got, want, torch.float32)


def test_stock_kernel_takes_an_expanded_output_gradient(monkeypatch):
    # out.sum().backward() hands the backward a gradient whose strides are all 0.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "stock")
    q, k, v = qkv(dtype=torch.float32, requires_grad=True)
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_inputs, causal_and(None, 9, 11))
    for got, want in zip(grads, torch.autograd.grad(ref_out.sum(), ref_inputs)):
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("forward_kernel,backward_kernel", [("own", "stock"), ("stock", "own")])
# Half types too: on AMX tiles the default runs torch's forward and fastmha's backward up to 512 keys.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_forward_and_backward_on_different_kernels(monkeypatch, forward_kernel, backward_kernel, dtype):
    # Rows with no visible key are where the kernels' own log-sum-exps differ: the saved one must serve both.
    q, k, v = qkv(lq=7, lk=8, dtype=dtype, requires_grad=True)
    mask = torch.ones(2, 1, 7, 8, dtype=torch.bool)
    mask[0, 0, 3] = False
    mask[1, 0, :, 5:] = False
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", forward_kernel)
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, False)
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", backward_kernel)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_inputs, mask)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad.double())
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype)


def test_kept_weights_forward_with_unused_weights_backward(monkeypatch):
    # need_weights=True runs fastmha's kernel; a loss that ignores the weights gives their gradient as
    # nothing, and the backward may then take the stock kernel.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "stock")
    q, k, v = qkv(dtype=torch.float32, requires_grad=True)
    mask = torch.ones(9, 11, dtype=torch.bool)
    mask[4] = False
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, False)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref_inputs, mask)
    for got, want in zip(grads, torch.autograd.grad(ref_out, ref_inputs, grad.double())):
        assert_close(got, want, torch.float32)


def test_backward_given_kept_weights_runs_fastmhas_kernel_at_any_length(monkeypatch, capfd):
    # Past 2048 keys without a mask too: with kept weights (float32, no dropout) fastmha's backward takes the
    # softmax from them, without it recomputes the scores.
    monkeypatch.setenv("FASTMHA_LOG_KERNELS", "1")
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 2100, 8, requires_grad=True) for _ in range(2))
    for need_weights in (False, True):
        out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, need_weights, False)
        out.sum().backward()
        backward = [line for line in capfd.readouterr().err.splitlines() if "fastmha: backward" in line]
        assert len(backward) == 1
        # fastmha.explain tells the same backward (that of a loss that does not read the weights).
        explained_kernel, explained_reason = choices(q, k, v, need_weights=need_weights)["backward"]
        assert backward[0].endswith(f"-> {explained_kernel} ({explained_reason})"), (backward[0], explained_reason)
        assert "-> fastmha-cpu" in backward[0]
        assert ("kept its weights" in backward[0]) == need_weights, backward[0]


def test_block_without_weights_takes_the_same_choice(monkeypatch, capfd):
    monkeypatch.setenv("FASTMHA_LOG_KERNELS", "1")
    block = fastmha.MultiHeadAttentionBlock(32, 4, 0.0, need_weights=False).double()
    x = torch.randn(2, 600, 32, dtype=torch.float64)  # torch's forward from 513 keys on in float64
    mask = padding_mask(2, 600)
    reference = fastmha.MultiHeadAttentionBlock(32, 4, 0.0, need_weights=True).double()
    reference.load_state_dict(block.state_dict())
    assert_close(block(x, x, x, mask), reference(x, x, x, mask), torch.float64)
    log = capfd.readouterr().err
    assert "-> torch-cpu-flash" in log and "-> fastmha-cpu" in log
