"""is_causal: the same result as adding tril(ones(Lq, Lk)) to the mask (top-left aligned), without the mask."""

import pytest
import torch
from conftest import assert_close
from oracle import OracleBlock, oracle_attention
from torch.autograd import gradcheck

import fastmha


def causal_mask(lq, lk, device):
    return torch.tril(torch.ones(lq, lk, dtype=torch.bool, device=device))


def combined(mask, lq, lk, device):
    causal = causal_mask(lq, lk, device)
    return causal if mask is None else (mask != 0) & causal


@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (5, 9), (9, 5), (70, 70), (100, 130), (130, 100)])
@pytest.mark.parametrize("need_weights", [True, False])
def test_causal_matches_explicit_tril_mask(device, lq, lk, need_weights):
    q, k, v = (torch.randn(2, 3, n, 8, device=device, dtype=torch.float64) for n in (lq, lk, lk))
    out, weights = torch.ops.fastmha.attention(q, k, v, None, 0.0, need_weights, True)
    ref_out, ref_weights = oracle_attention(q, k, v, causal_mask(lq, lk, device))
    torch.testing.assert_close(out, ref_out)
    if need_weights:
        torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("lq,lk", [(6, 6), (70, 90), (90, 70)])
def test_causal_with_padding_and_fully_masked_rows(device, lq, lk):
    # Padding that hides the first keys masks the first queries' causal window entirely: those rows must be
    # uniform over all Lk keys, exactly as with the explicit combined mask.
    q, k, v = (torch.randn(2, 2, n, 8, device=device, dtype=torch.float64) for n in (lq, lk, lk))
    mask = torch.ones(2, 1, 1, lk, dtype=torch.bool, device=device)
    mask[0, ..., :3] = False
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True, True)
    ref_out, ref_weights = oracle_attention(q, k, v, combined(mask, lq, lk, device))
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(weights[0, :, 0], torch.full((2, lk), 1.0 / lk, device=device, dtype=torch.float64))


@pytest.mark.parametrize("need_weights", [True, False])
def test_causal_gradcheck(device, need_weights):
    q, k, v = (torch.randn(1, 2, n, 4, device=device, dtype=torch.float64, requires_grad=True) for n in (5, 6, 6))
    mask = torch.tensor([0, 1, 1, 1, 0, 1], device=device)

    def fn(q, k, v):
        out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, need_weights, True)
        return (out, weights) if need_weights else out

    assert gradcheck(fn, (q, k, v))


def test_causal_gradients_match_oracle_with_fully_masked_rows(device):
    lq = lk = 70
    q, k, v = (torch.randn(1, 2, n, 8, device=device, dtype=torch.float64, requires_grad=True) for n in (lq, lk, lk))
    mask = torch.ones(lk, dtype=torch.bool, device=device)
    mask[:2] = False
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_out, _ = oracle_attention(q, k, v, combined(mask, lq, lk, device))
    ref = torch.autograd.grad(ref_out.square().sum(), (q, k, v))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_module_keyword(device, dtype):
    block = fastmha.MultiHeadAttentionBlock(16, 4, 0.0, is_causal=True).to(device, dtype)
    oracle = OracleBlock(16, 4).to(device, torch.float64)
    oracle.load_state_dict({k: v.double() for k, v in block.state_dict().items()})
    x = torch.randn(2, 9, 16, device=device, dtype=dtype)
    out = block(x, x, x, None)
    ref_out, ref_weights = oracle(x.double(), x.double(), x.double(), causal_mask(9, 9, device))
    assert_close(out, ref_out, dtype)
    assert_close(block.attention_scores, ref_weights, dtype)
    assert "is_causal=True" in repr(block)
