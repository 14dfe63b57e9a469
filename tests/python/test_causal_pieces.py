"""is_causal on fastmha's own kernels, at sizes where a chunk of query rows folds its diagonal key block in pieces
(each by the rows that see some key of it; forward, and backward where its products run in T) and a row cut short
by causality takes its weights over the keys it sees, zeros beyond: the same output and gradients as the oracle's
explicit lower-triangular mask, in every dtype, with chunks
of 128 and 256 rows, key blocks that end inside and beyond the diagonal, Lq != Lk and head sizes that pad; and where
the keys a row does not see weigh something after all (every score it sees below -1e9: the hidden keys take all the
weight) or hide a NaN or an infinity (zero weight times it is NaN); with dropout, the draw of each row and key.
"""

import pytest
import torch
from conftest import assert_close
from oracle import oracle_attention

import fastmha  # noqa: F401  (loads the ops)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# 8 heads in all: a chunk holds 128 rows (L 128) or 256 (longer), so its diagonal block is folded in pieces.
SHAPES = [(2, 4, 128, 128), (1, 8, 300, 300), (1, 8, 520, 400), (1, 8, 260, 700)]


def causal(lq, lk):
    return torch.tril(torch.ones(lq, lk, dtype=torch.bool))


def own_forward(monkeypatch, q, k, v, block, half_gemm):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", half_gemm)
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, True)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("block", ["", "64", "100"], ids=["block=auto", "block=64", "block=100"])
@pytest.mark.parametrize("half_gemm", ["auto", "reference"])
def test_causal_chunks_match_the_oracle(monkeypatch, dtype, shape, d, block, half_gemm):
    if dtype.itemsize != 2 and half_gemm != "auto":
        pytest.skip("products in the half type are for half types")
    b, h, lq, lk = shape
    q, k, v = (torch.randn(b, h, n, d).to(dtype) for n in (lq, lk, lk))
    out = own_forward(monkeypatch, q, k, v, block, half_gemm)
    ref, _ = oracle_attention(q.double(), k.double(), v.double(), causal(lq, lk))
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", [256, 300])  # one chunk of all rows and keys; two
@pytest.mark.parametrize("block", ["", "64"], ids=["block=auto", "block=64"])
@pytest.mark.parametrize("half_gemm", ["auto", "reference"])
def test_hidden_keys_take_the_weight_when_every_seen_score_is_below_minus_1e9(
    monkeypatch, dtype, length, block, half_gemm
):
    if dtype.itemsize != 2 and half_gemm != "auto":
        pytest.skip("products in the half type are for half types")
    lq = lk = length
    # Every score is -2^33 (exact in every dtype and in fp32 sums): below the -1e9 of the keys a row does not see,
    # which then share all its weight; the last row sees every key and is uniform over them.
    q = torch.full((1, 8, lq, 64), 2.0**15).to(dtype)
    k = torch.full((1, 8, lk, 64), -(2.0**15)).to(dtype)
    v = torch.randn(1, 8, lk, 64).to(dtype)
    out = own_forward(monkeypatch, q, k, v, block, half_gemm)
    ref, _ = oracle_attention(q.double(), k.double(), v.double(), causal(lq, lk))
    torch.testing.assert_close(ref[..., 0, :], v[..., 1:, :].double().mean(-2))  # the oracle as described
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("special", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_value_past_the_diagonal_spoils_the_rows_before_it(monkeypatch, dtype, special):
    lq = lk = 300
    q, k, v = (torch.randn(1, 8, n, 64).to(dtype) for n in (lq, lk, lk))
    v[0, 3, 200, 5] = special  # rows 0 .. 199 of head 3 give it weight 0: NaN in column 5
    out = own_forward(monkeypatch, q, k, v, "", "auto")
    ref, _ = oracle_attention(q.double(), k.double(), v.double(), causal(lq, lk))
    assert torch.isnan(ref[0, 3, :200, 5]).all()
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert_close(out[finite], ref[finite], dtype)



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("half_gemm", ["auto", "reference"])
def test_dropout_in_pieces_keeps_the_forwards_draw(monkeypatch, dtype, half_gemm):
    if dtype.itemsize != 2 and half_gemm != "auto":
        pytest.skip("products in the half type are for half types")
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", half_gemm)
    lq, lk, p = 300, 280, 0.3
    q, k, v = (torch.randn(1, 8, n, 64).to(dtype) for n in (lq, lk, lk))
    out, _, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, None, p, False, True)
    keep = torch.ops.fastmha._dropout_multipliers([1, 8, lq, lk], p, torch.float64, rng_state) != 0
    ref, _ = oracle_attention(q.double(), k.double(), v.double(), causal(lq, lk), keep, p)
    assert_close(out, ref, dtype)


def own_gradients(monkeypatch, q, k, v, block, half_gemm):
    """Output and (dQ, dK, dV) of fastmha's own kernels for the loss sum(output * G), and G (fixed)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = own_forward(monkeypatch, q, k, v, block, half_gemm)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return out, torch.autograd.grad((out * weight).sum(), (q, k, v)), weight


def oracle_gradients(q, k, v, weight, keep=None, p=0.0):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, _ = oracle_attention(q, k, v, causal(q.shape[2], k.shape[2]), keep, p)
    return out, torch.autograd.grad((out * weight.double()).sum(), (q, k, v))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("block", ["", "64"], ids=["block=auto", "block=64"])
@pytest.mark.parametrize("half_gemm", ["auto", "widen"])
def test_causal_gradients_match_the_oracle(monkeypatch, dtype, shape, block, half_gemm):
    if dtype.itemsize != 2 and half_gemm != "auto":
        pytest.skip("products in the half type are for half types")
    b, h, lq, lk = shape
    q, k, v = (torch.randn(b, h, n, 64).to(dtype) for n in (lq, lk, lk))
    out, grads, weight = own_gradients(monkeypatch, q, k, v, block, half_gemm)
    ref_out, ref_grads = oracle_gradients(q, k, v, weight)
    assert_close(out, ref_out, dtype)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("length", [256, 300])
def test_gradients_where_hidden_keys_take_the_weight(monkeypatch, length):
    # Scores of about -2^33, as above, that vary from key to key: in float64, where they are exact (float32 rounds
    # such scores by hundreds, which changes their softmax; the kernels' code is the same template).
    dtype = torch.float64
    q = (2.0**15 + torch.randint(-4, 4, (1, 8, length, 64)) * 2.0**-3).to(dtype)
    k = -(2.0**15 + torch.randint(-4, 4, (1, 8, length, 64)) * 2.0**-3).to(dtype)
    v = torch.randn(1, 8, length, 64).to(dtype)
    out, grads, weight = own_gradients(monkeypatch, q, k, v, "", "auto")
    ref_out, ref_grads = oracle_gradients(q, k, v, weight)
    assert_close(out, ref_out, dtype)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_dropout_gradients_in_pieces_keep_the_forwards_draw(monkeypatch, dtype):
    q, k, v = (torch.randn(1, 8, n, 64).to(dtype) for n in (300, 280, 280))
    p = 0.3
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.manual_seed(5)
    out, _ = torch.ops.fastmha.attention(q, k, v, None, p, False, True)
    torch.manual_seed(5)
    _, _, _, rng_state = torch.ops.fastmha._attention_forward(q.detach(), k.detach(), v.detach(), None, p, False, True)
    keep = torch.ops.fastmha._dropout_multipliers([1, 8, 300, 280], p, torch.float64, rng_state) != 0
    weight = torch.randn(out.shape, dtype=dtype)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref_out, ref_grads = oracle_gradients(q, k, v, weight, keep, p)
    assert_close(out, ref_out, dtype)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype)
