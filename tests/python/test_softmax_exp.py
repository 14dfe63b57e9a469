"""The softmax's exp in fastmha's CPU kernels (its own polynomial on AVX-512): the row sums come from the same exp as
the weights, so the log-sum-exp that the forward returns (and the backward recomputes the weights from) shows its
accuracy. Checked against the float64 oracle of the same inputs on fastmha's own kernel: in float32, and in the half
types, whose weights are rounded for the products P V (`reference` on any CPU, `native` where the CPU has them),
for sharp and flat rows, rows a padding mask cuts short, and key blocks smaller than the rows.
"""

import pytest
import torch
from conftest import assert_close

import fastmha

B, H, LQ, LK, D = 2, 2, 130, 300, 64


def half_products(mode, dtype):
    """Whether FASTMHA_CPU_HALF_GEMM=mode multiplies `dtype` in the half type on this CPU."""
    q = torch.randn(1, 1, 4, 8, dtype=dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTMHA_CPU_HALF_GEMM", mode)
        note = fastmha.explain(q, q, q, None, 0.0, True).splitlines()[0]
    return "widened" not in note


def oracle_log_sum_exp(q, k, mask):
    scores = q.double() @ k.double().transpose(-1, -2) / D**0.5
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    return torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["reference", "native"])
@pytest.mark.parametrize("spread", [0.1, 3.0], ids=["flat rows", "sharp rows"])
@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("block", ["64", ""], ids=["block=64", "block=auto"])
def test_half_type_forward_log_sum_exp_matches_the_oracle(monkeypatch, dtype, mode, spread, padded, block):
    if not half_products(mode, dtype):
        pytest.skip(f"this CPU has no native {dtype} products")
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", mode)
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D).mul(spread).to(dtype) for L in (LQ, LK, LK))
    mask = None
    if padded:
        mask = torch.ones(B, 1, 1, LK, dtype=torch.bool)
        mask[0, ..., 40:] = False  # 40 keys seen, the rest padding
    out, _, lse, _ = torch.ops.fastmha._attention_forward(q, k, v, mask, 0.0, False, False)
    assert lse.shape == (B, H, LQ) and torch.isfinite(lse).all()
    # The polynomial exp of the AVX-512 kernels is within about 3e-6 of exp; elsewhere torch's fast exp for half-type
    # results, within about 1.1e-4. The sums' own rounding adds a few 1e-7.
    tolerance = 2e-5 if fastmha._C.cpu_capability() == "avx512" else 3e-4
    torch.testing.assert_close(lse.double(), oracle_log_sum_exp(q, k, mask), rtol=0, atol=tolerance)


@pytest.mark.parametrize("spread", [0.1, 3.0], ids=["flat rows", "sharp rows"])
@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("block", ["64", ""], ids=["block=64", "block=auto"])
def test_float32_log_sum_exp_and_gradients_match_the_oracle(monkeypatch, spread, padded, block):
    # The forward's log-sum-exp within a few fp32 roundings of the float64 oracle (the exp within 2e-7 near 0 on
    # AVX-512, 1e-6 elsewhere; the scores' own rounding grows with them), and the backward's gradients, which
    # recompute the weights from it, within the suite's float32 tolerance.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D).mul(spread).requires_grad_() for L in (LQ, LK, LK))
    mask = None
    if padded:
        mask = torch.ones(B, 1, 1, LK, dtype=torch.bool)
        mask[0, ..., 40:] = False
    out, _, lse, _ = torch.ops.fastmha._attention_forward(q, k, v, mask, 0.0, False, False)
    torch.testing.assert_close(lse.double(), oracle_log_sum_exp(q.detach(), k.detach(), mask), rtol=1e-6, atol=3e-6)
    grad = torch.randn(B, H, LQ, D)
    got = torch.autograd.grad(torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, False)[0], (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / D**0.5
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    want = torch.autograd.grad(torch.softmax(scores, -1) @ v64, (q64, k64, v64), grad.double())
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
