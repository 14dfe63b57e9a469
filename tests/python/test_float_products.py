"""The CPU forward's float32 P V, and the blocked backward's four products, on oneDNN's brgemm
(FASTMHA_CPU_FLOAT_GEMM): the same results as on the BLAS and as the oracle, for every block shape the forward and
the backward meet, and the switch's choice as fastmha.explain reports it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close, cpu_flags
from layouts import RELAYOUTS, relaid
from oracle import oracle_attention
from philox_reference import expected_keep

import fastmha

ON_BRGEMM = "the forward's P V on oneDNN's brgemm"
BACKWARD_ON_BRGEMM = "the blocked backward's products on oneDNN's brgemm"


def forward_note(q, k, v, mask=None, need_weights=False, is_causal=False):
    line = fastmha.explain(q, k, v, mask, 0.0, need_weights, is_causal).splitlines()[0]
    assert line.startswith("forward fastmha-cpu"), line
    return line


def brgemm_runs_here():
    """Whether FASTMHA_CPU_FLOAT_GEMM=brgemm puts the products on brgemm on this machine: x86-64 with AVX2, oneDNN
    in torch."""
    return "avx2" in cpu_flags() and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def amd_with_avx512():
    """An AMD processor on which fastmha runs its AVX-512 kernels (ATEN_CPU_CAPABILITY may ask for fewer)."""
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        amd = "AuthenticAMD" in cpuinfo.read()
    return amd and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags() and \
        fastmha._C.cpu_capability() == "avx512"


@pytest.fixture(params=["blas", "brgemm"])
def float_gemm(request, monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")  # the forward's products are fastmha's kernel's
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", request.param)
    return request.param


def visible(b, lq, lk, kept):
    """A (B, 1, Lq, Lk) mask: each batch keeps its first kept[i] keys, with a hole of hidden keys in the middle."""
    mask = torch.zeros(b, 1, lq, lk, dtype=torch.bool)
    for i, n in enumerate(kept):
        mask[i, ..., :n] = True
        mask[i, ..., n // 3:n // 2] = False
    return mask


# Key lengths: one short block, a block of 512, and two blocks, the second shorter (the forward's key block is
# 1024 keys at these head sizes, fewer for larger ones).
@pytest.mark.parametrize("lk", [37, 512, 1300])
@pytest.mark.parametrize("layout", RELAYOUTS + ["heads interleaved"])
def test_forward_matches_the_oracle_in_every_layout(float_gemm, lk, layout):
    torch.manual_seed(lk)
    q = torch.randn(2, 3, 40, 24)
    k, v = torch.randn(2, 3, lk, 24), torch.randn(2, 3, lk, 40)  # d_v != d_k
    if layout == "heads interleaved":  # rows H * d apart, as the block's head split of a projection leaves them
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    else:
        k, v = relaid(k, layout), relaid(v, layout)
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
    want, _ = oracle_attention(q.double(), k.double(), v.double())
    assert_close(out, want, torch.float32)
    assert (ON_BRGEMM in forward_note(q, k, v)) == (float_gemm == "brgemm" and brgemm_runs_here())


@pytest.mark.parametrize("need_weights", [False, True])
def test_masked_and_causal_forwards_match_the_oracle(float_gemm, need_weights):
    torch.manual_seed(1)
    b, lq, lk = 3, 70, 900
    q, k, v = torch.randn(b, 2, lq, 32), torch.randn(b, 2, lk, 32), torch.randn(b, 2, lk, 32)
    mask = visible(b, lq, lk, [900, 333, 41])
    for is_causal, m in ((False, mask), (True, None), (True, mask)):
        out, weights = torch.ops.fastmha.attention(q, k, v, m, 0.0, need_weights, is_causal)
        tril = torch.ones(lq, lk, dtype=torch.bool).tril()
        full = m if not is_causal else (tril if m is None else tril & m)
        want, want_weights = oracle_attention(q.double(), k.double(), v.double(), full)
        assert_close(out, want, torch.float32)
        if need_weights:
            assert_close(weights, want_weights, torch.float32)


# Key lengths as above; the blocked backward walks the keys in blocks of its own, with causal pieces of rows.
@pytest.mark.parametrize("lk", [37, 512, 1300])
@pytest.mark.parametrize("case", ["plain", "masked", "causal", "weights kept"])
def test_backward_matches_the_oracle(float_gemm, lk, case):
    torch.manual_seed(lk)
    b, lq = 2, 70
    q, k, v = torch.randn(b, 3, lq, 24), torch.randn(b, 3, lk, 24), torch.randn(b, 3, lk, 40)  # d_v != d_k
    mask = visible(b, lq, lk, [lk, max(1, lk // 3)]) if case == "masked" else None
    is_causal, need_weights = case == "causal", case == "weights kept"
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = torch.ops.fastmha.attention(*leaves, mask, 0.0, need_weights, is_causal)
    grad = torch.randn_like(out)
    out.backward(grad)
    wide = [t.double().requires_grad_(True) for t in (q, k, v)]
    full = torch.ones(lq, lk, dtype=torch.bool).tril() if is_causal else mask
    oracle_attention(*wide, full)[0].backward(grad.double())
    for name, got, want in zip("qkv", leaves, wide):
        assert_close(got.grad, want.grad, torch.float32, f"grad of {name}")
    line = fastmha.explain(q, k, v, mask, 0.0, need_weights, is_causal).splitlines()[1]
    assert line.startswith("backward fastmha-cpu"), line
    assert (BACKWARD_ON_BRGEMM in line) == (float_gemm == "brgemm" and brgemm_runs_here()), line


@pytest.mark.parametrize("key_block", ["", "32"])
@pytest.mark.parametrize("case", ["plain", "causal", "weights kept with dropout"])
def test_backward_of_one_head_split_across_tasks_matches_the_oracle(float_gemm, monkeypatch, key_block, case):
    """One head's query chunks split into ranges that run as tasks of their own (each with its own dK and dV, and
    on brgemm its own sums of dK^T and dV^T), over one or many key blocks ("32")."""
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", key_block)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(11)
        q, k, v = torch.randn(1, 1, 700, 24), torch.randn(1, 1, 650, 24), torch.randn(1, 1, 650, 40)
        is_causal, p = case == "causal", 0.1 if case.endswith("dropout") else 0.0
        out, weights, lse, rng_state = torch.ops.fastmha._attention_forward(q, k, v, None, p, True, is_causal)
        grad = torch.randn_like(out)
        kept = weights if p > 0 else None
        got = torch.ops.fastmha._attention_backward(grad, None, q, k, v, None, out, lse, rng_state, p, is_causal,
                                                    kept)
    finally:
        torch.set_num_threads(threads)
    keep = None
    if p > 0:
        seed, offset = (int(x) for x in rng_state)
        keep = expected_keep(seed & (2**64 - 1), offset, tuple(weights.shape), p)
    wide = [t.double().requires_grad_(True) for t in (q, k, v)]
    full = torch.ones(700, 650, dtype=torch.bool).tril() if is_causal else None
    oracle_attention(*wide, full, keep, p)[0].backward(grad.double())
    for name, got_grad, want in zip("qkv", got, wide):
        assert_close(got_grad, want.grad, torch.float32, f"grad of {name}")


def test_dropout_and_widened_half_types_agree_with_the_blas(monkeypatch):
    """The same call on both GEMMs: the same dropout mask (the same stream), the same numbers up to rounding."""
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 2, 64, 32), torch.randn(2, 2, 700, 32), torch.randn(2, 2, 700, 32)
    for dtype, p in ((torch.float32, 0.3), (torch.bfloat16, 0.0), (torch.float16, 0.2)):
        results = {}
        for mode in ("blas", "brgemm"):
            monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", mode)
            torch.manual_seed(7)
            results[mode] = torch.ops.fastmha.attention(q.to(dtype), k.to(dtype), v.to(dtype), None, p, True, False)
        out, weights = results["brgemm"]
        assert torch.equal(weights, results["blas"][1])  # the weights come before the product
        assert_close(out, results["blas"][0], dtype)


def test_backward_with_dropout_and_kept_weights_agrees_with_the_blas(monkeypatch):
    """The kept weights carry the dropout: the backward's gradients on both GEMMs, the same up to rounding."""
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 2, 90, 32), torch.randn(2, 2, 700, 32), torch.randn(2, 2, 700, 32)
    grad = torch.randn(2, 2, 90, 32)
    results = {}
    for mode in ("blas", "brgemm"):
        monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", mode)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(8)
        torch.ops.fastmha.attention(*leaves, None, 0.3, True, False)[0].backward(grad)
        results[mode] = [t.grad for t in leaves]
    for name, got, want in zip("qkv", results["brgemm"], results["blas"]):
        assert_close(got, want, torch.float32, f"grad of {name}")


def test_more_shapes_than_the_process_keeps_on_brgemm_stay_right(monkeypatch):
    """Past the shapes the process runs on brgemm (float_gemm.h), the rest run on the BLAS, still right."""
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "brgemm")
    torch.manual_seed(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for lk in range(100, 100 + 45):  # a new product shape per key length
            q, k, v = torch.randn(1, 1, 5, 16), torch.randn(1, 1, lk, 16), torch.randn(1, 1, lk, 16)
            out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
            assert_close(out, oracle_attention(q.double(), k.double(), v.double())[0], torch.float32)
    finally:
        torch.set_num_threads(threads)


def test_auto_takes_brgemm_on_amd_processors_with_avx512_only(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.delenv("FASTMHA_CPU_FLOAT_GEMM", raising=False)
    q = torch.randn(1, 2, 16, 8)
    expected = amd_with_avx512() and brgemm_runs_here()
    assert (ON_BRGEMM in forward_note(q, q, q)) == expected
    assert (BACKWARD_ON_BRGEMM in fastmha.explain(q, q, q, None, 0.0, False, False).splitlines()[1]) == expected
    # float64 multiplies on the BLAS's dgemm whatever the switch says; half types' backward too.
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "brgemm")
    assert ON_BRGEMM not in forward_note(q.double(), q.double(), q.double())
    for dtype in (torch.float64, torch.bfloat16):
        t = q.to(dtype)
        assert "brgemm" not in fastmha.explain(t, t, t, None, 0.0, False, False).splitlines()[1]


def test_brgemm_without_onednn_says_so_and_runs_on_the_blas(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "brgemm")
    q, k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8)
    with torch.backends.mkldnn.flags(enabled=False):
        assert "oneDNN's brgemm does not run here (FASTMHA_CPU_FLOAT_GEMM=brgemm)" in forward_note(q, k, v)
        out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
    assert_close(out, oracle_attention(q.double(), k.double(), v.double())[0], torch.float32)


def test_a_bad_switch_value_is_refused_in_any_dtype(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "mkl")
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        q = torch.randn(1, 1, 4, 8, dtype=dtype)
        with pytest.raises(RuntimeError, match="FASTMHA_CPU_FLOAT_GEMM must be auto, blas or brgemm, got 'mkl'"):
            torch.ops.fastmha.attention(q, q, q, None, 0.0, False, False)


def test_float32_forward_on_brgemm_runs_fastmhas_kernel_beyond_512_keys_from_1024_queries(monkeypatch):
    """Without a mask the default runs torch's forward beyond 512 keys, unless the P V would run on brgemm and a
    head has 1024 query rows or more (as measured; fewer rows make a new product shape at every length), or, in
    float32, fastmha's kernels run AVX-512 (at any number of query rows)."""
    monkeypatch.delenv("FASTMHA_CPU_KERNELS", raising=False)
    k = torch.randn(1, 2, 513, 16)
    for mode, dtype, rows in (("brgemm", torch.float32, 1024), ("brgemm", torch.float32, 1023),
                              ("blas", torch.float32, 1024), ("brgemm", torch.float64, 1024)):
        monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", mode)
        q = torch.randn(1, 2, rows, 16, dtype=dtype)
        line = fastmha.explain(q, k.to(dtype), k.to(dtype), None, 0.0, False, False).splitlines()[0]
        on_brgemm = mode == "brgemm" and dtype == torch.float32 and rows >= 1024 and brgemm_runs_here()
        on_avx512 = dtype == torch.float32 and fastmha._C.cpu_capability() == "avx512"
        own = on_brgemm or on_avx512
        assert line.startswith("forward fastmha-cpu" if own else "forward torch-cpu-flash"), line
        assert ("faster than torch's beyond 512 keys too" in line) == own, line
        assert ("on oneDNN's brgemm over 1024 query rows" in line) == (on_brgemm and not on_avx512), line


FRESH_PROCESS = """
import torch
from conftest import assert_close
from oracle import oracle_attention

torch.manual_seed(0)
q = torch.randn(2, 3, 70, 24)
# Values and keys in the head split of a projection (rows H * d apart), two key blocks, the second shorter.
k, v = (torch.randn(2, 1300, 3, d).transpose(1, 2) for d in (24, 40))
mask = torch.ones(2, 1, 70, 1300, dtype=torch.bool)
mask[1, ..., 400:700] = False
for m, need_weights in ((None, False), (mask, True)):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, weights = torch.ops.fastmha.attention(*leaves, m, 0.0, need_weights, False)
    wide = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want, want_weights = oracle_attention(*wide, m)
    assert_close(out, want, torch.float32)
    if need_weights:
        assert_close(weights, want_weights, torch.float32)
    grad = torch.randn_like(out)
    out.backward(grad)  # the blocked backward's products
    want.backward(grad.double())
    for got, expected in zip(leaves, wide):
        assert_close(got.grad, expected.grad, torch.float32)
print("checked")
"""


def test_a_fresh_process_runs_its_products_on_brgemm_and_right():
    """In this process the shapes that earlier tests ran on brgemm may have taken every place there; a fresh
    process meets these few shapes first (the forward's and the backward's), so where brgemm runs, it runs them
    all."""
    if not brgemm_runs_here():
        pytest.skip("oneDNN's float32 brgemm does not run here")
    env = {**os.environ, "FASTMHA_CPU_KERNELS": "own", "FASTMHA_CPU_FLOAT_GEMM": "brgemm"}
    run = subprocess.run([sys.executable, "-c", "import fastmha\n" + FRESH_PROCESS], cwd=Path(__file__).parent,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "checked", run.stderr
