"""The attention core (torch.ops.fastmha.attention) against the oracle: shapes, masks, dtypes, layouts."""

import pytest
import torch
from conftest import assert_close
from oracle import oracle_attention

B, H, LQ, LK, DK = 2, 3, 5, 7, 8


def make_qkv(device, dtype, lq=LQ, lk=LK, dk=DK, dv=None, b=B, h=H):
    dv = dk if dv is None else dv
    return (torch.randn(b, h, lq, dk, device=device, dtype=dtype),
            torch.randn(b, h, lk, dk, device=device, dtype=dtype),
            torch.randn(b, h, lk, dv, device=device, dtype=dtype))


def check_against_oracle(q, k, v, mask=None):
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, True)
    ref_out, ref_weights = oracle_attention(q.double(), k.double(), v.double(), mask)
    assert out.dtype == q.dtype and weights.dtype == q.dtype
    assert_close(weights, ref_weights, q.dtype)
    assert_close(out, ref_out, q.dtype)
    return out, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_dot_product_no_mask(device, dtype):
    check_against_oracle(*make_qkv(device, dtype))


def test_scale_is_one_over_sqrt_d_k(device):
    # Two keys whose scores differ by exactly sqrt(d_k) * 1 after Q K^T: softmax gives sigmoid(1).
    d_k = 16
    q = torch.zeros(1, 1, 1, d_k, dtype=torch.float64, device=device)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 2, d_k, dtype=torch.float64, device=device)
    k[0, 0, 0, 0] = d_k ** 0.5
    v = torch.randn(1, 1, 2, 3, dtype=torch.float64, device=device)
    _, weights = torch.ops.fastmha.attention(q, k, v)
    expected = torch.sigmoid(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(weights[0, 0, 0, 0].cpu(), expected)


@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 9), (9, 1), (4, 11), (13, 6)])
def test_cross_attention_lengths(device, lq, lk):
    check_against_oracle(*make_qkv(device, torch.float64, lq=lq, lk=lk))


def test_value_head_size_may_differ(device):
    out, _ = check_against_oracle(*make_qkv(device, torch.float64, dv=5))
    assert out.shape == (B, H, LQ, 5)


MASK_SHAPES = {
    "padding (B,1,1,Lk)": (B, 1, 1, LK),
    "decoder (B,1,Lq,Lk)": (B, 1, LQ, LK),
    "(Lq,Lk)": (LQ, LK),
    "per-head (B,H,Lq,Lk)": (B, H, LQ, LK),
    "(1,H,1,Lk)": (1, H, 1, LK),
    "(Lk,)": (LK,),
}


@pytest.mark.parametrize("shape", list(MASK_SHAPES.values()), ids=list(MASK_SHAPES))
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32,
                                        torch.float64])
def test_mask_shapes_and_dtypes(device, shape, mask_dtype):
    q, k, v = make_qkv(device, torch.float64)
    mask = (torch.rand(shape, device=device) > 0.3).to(mask_dtype)
    _, weights = check_against_oracle(q, k, v, mask)
    # Masked positions get (numerically) zero weight unless the whole row is masked.
    full = mask.expand(B, H, LQ, LK)
    rows_alive = (full != 0).any(-1, keepdim=True).expand_as(full)
    assert torch.all(weights[(full == 0) & rows_alive] < 1e-30)


def test_float_mask_uses_equality_with_zero(device):
    q, k, v = make_qkv(device, torch.float64)
    # Non-zero values (negative, fractional) keep the position; only exact zeros mask it.
    mask = torch.tensor([0.0, -1.0, 0.5, 2.0, 0.0, 1e-30, 3.0], device=device, dtype=torch.float64)
    check_against_oracle(q, k, v, mask)


def test_causal_mask(device):
    q, k, v = make_qkv(device, torch.float64, lq=6, lk=6)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool, device=device))
    _, weights = check_against_oracle(q, k, v, causal)
    assert torch.all(weights.triu(1) == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fully_masked_row_is_uniform(device, dtype):
    q, k, v = make_qkv(device, dtype)
    mask = torch.ones(B, 1, LQ, LK, device=device, dtype=torch.bool)
    mask[0, 0, 2, :] = False
    out, weights = check_against_oracle(q, k, v, mask)
    assert not torch.isnan(weights).any() and not torch.isnan(out).any()
    torch.testing.assert_close(weights[0, :, 2], torch.full((H, LK), 1.0 / LK, device=device, dtype=dtype))
    torch.testing.assert_close(out[0, :, 2], v[0].mean(dim=1))


def test_non_contiguous_inputs(device):
    q, k, v = make_qkv(device, torch.float64)
    # Transposed storage, strided slices and an expanded (stride 0) batch.
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)
    kt = torch.randn(B, H, 2 * LK, DK, device=device, dtype=torch.float64)[:, :, ::2]
    vt = torch.randn(1, H, LK, DK, device=device, dtype=torch.float64).expand(B, H, LK, DK)
    mask = (torch.rand(LK, B, device=device) > 0.3).t()[:, None, None, :]
    assert not (qt.is_contiguous() or kt.is_contiguous() or vt.is_contiguous() or mask.is_contiguous())
    check_against_oracle(qt, kt, vt, mask)


def test_need_weights_false_returns_empty_weights(device):
    q, k, v = make_qkv(device, torch.float64)
    out, weights = torch.ops.fastmha.attention(q, k, v, None, 0.0, False)
    ref_out, _ = oracle_attention(q, k, v)
    assert weights.numel() == 0
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("b,lq,lk", [(0, 4, 5), (2, 0, 5), (2, 4, 0), (0, 0, 0)])
def test_empty_inputs_give_empty_shaped_results(device, b, lq, lk):
    q, k, v = make_qkv(device, torch.float64, b=b, lq=lq, lk=lk)
    out, weights = torch.ops.fastmha.attention(q, k, v)
    ref_out, ref_weights = oracle_attention(q, k, v)
    assert out.shape == ref_out.shape and weights.shape == ref_weights.shape
    torch.testing.assert_close(out, ref_out)


def test_inputs_are_not_modified(device):
    q, k, v = make_qkv(device, torch.float32)
    mask = torch.rand(B, 1, 1, LK, device=device) > 0.5
    before = [t.clone() for t in (q, k, v, mask)]
    torch.ops.fastmha.attention(q, k, v, mask, 0.3, True)
    for t, saved in zip((q, k, v, mask), before):
        assert torch.equal(t, saved)


def test_outputs_do_not_alias_inputs(device):
    q, k, v = make_qkv(device, torch.float32)
    out, weights = torch.ops.fastmha.attention(q, k, v)
    for t in (q, k, v):
        assert out.data_ptr() != t.data_ptr() and weights.data_ptr() != t.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_accumulate_in_fp32(device, dtype):
    q, k, v = make_qkv(device, dtype)
    mask = torch.ones(B, 1, LQ, LK, device=device, dtype=torch.bool)
    mask[1, 0, 0] = False  # the -1e9 fill must stay finite in half types
    out, weights = check_against_oracle(q, k, v, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(weights[1, :, 0].float(), torch.full((H, LK), 1.0 / LK, device=device),
                               atol=1e-3, rtol=1e-2)
