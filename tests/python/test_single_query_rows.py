"""Few query rows per head (decoding steps) in the CPU kernel: a single row multiplies on vector loops instead of the
BLAS (scores as eight dots at a time, P V with each output row held in registers), a few rows of small products on
the same loops. Head sizes of whole vectors and of partial ones, key lengths across the loops' groups of eight and
the forward's key blocks, against the oracle in float32 and float64, forward and backward."""

import pytest
import torch
from conftest import assert_close
from oracle import oracle_attention

import fastmha  # noqa: F401

# 16 and 32 fill one or two vectors of 16 floats (AVX-512), 64 and 128 four and eight (the most held in registers);
# 8, 24, 80 and 136 leave a partial vector, or exceed the registers, and take the other loops.
HEAD_SIZES = [8, 16, 24, 32, 64, 80, 128, 136]
# 1-9 keys: fewer than a group of eight dots and one past it; 1300 and 2100 span two and three key blocks.
KEY_LENGTHS = [1, 7, 9, 300, 1300, 2100]


@pytest.fixture(autouse=True)
def own_kernel(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lk", KEY_LENGTHS)
@pytest.mark.parametrize("d", HEAD_SIZES)
def test_one_query_row_matches_the_oracle(dtype, lk, d):
    torch.manual_seed(d * 10000 + lk)
    q, k, v = torch.randn(2, 3, 1, d, dtype=dtype), torch.randn(2, 3, lk, d, dtype=dtype), \
        torch.randn(2, 3, lk, d, dtype=dtype)
    want, want_weights = oracle_attention(q.double(), k.double(), v.double())
    for need_weights in (False, True):
        out, weights = torch.ops.fastmha.attention(q, k, v, None, 0.0, need_weights, False)
        assert_close(out, want, dtype)
        if need_weights:
            assert_close(weights, want_weights, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lq", [1, 2, 5])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
def test_few_query_rows_masked_forward_and_backward_match_the_oracle(dtype, lq, d):
    torch.manual_seed(lq * 1000 + d)
    lk = 700
    q, k, v = (torch.randn(2, 2, n, d, dtype=dtype, requires_grad=True) for n in (lq, lk, lk))
    mask = torch.rand(2, 1, lq, lk) > 0.3
    mask[0, :, :, 400:] = False  # padding: a run of hidden keys
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, False)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, _ = oracle_attention(*wide, mask)
    assert_close(out, want, dtype)
    grad = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), grad),
                             torch.autograd.grad(want, wide, grad.double())):
        assert_close(got, expected, dtype)


def test_one_query_row_on_strided_inputs_and_nonfinite_scores():
    # Rows of keys and values a head's width apart (the block's head split of one projection), and a query whose
    # scores are infinite: NaN rows, exactly as the oracle gives them.
    torch.manual_seed(5)
    k = torch.randn(1, 500, 4, 64).transpose(1, 2)  # (1, 4, 500, 64), rows 256 floats apart
    v = torch.randn(1, 500, 4, 64).transpose(1, 2)
    q = torch.randn(1, 4, 1, 64)
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
    assert_close(out, oracle_attention(q.double(), k.double(), v.double())[0], torch.float32)
    q[0, 1, 0, 0] = float("inf")
    out, _ = torch.ops.fastmha.attention(q, k, v, None, 0.0, False, False)
    want = oracle_attention(q.double(), k.double(), v.double())[0]
    assert torch.equal(out.isnan(), want.isnan())
    assert_close(out[:, [0, 2, 3]], want[:, [0, 2, 3]], torch.float32)
