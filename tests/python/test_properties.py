"""Property-based tests (hypothesis): random shapes, lengths (0 and 1 included), layouts, masks and dtypes,
checked against the oracle, forward and backward. Seeds are printed on failure; HYPOTHESIS_PROFILE=long
runs many more examples than the bounded CI profile."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layouts import relaid
from oracle import OracleBlock, oracle_attention

import fastmha

settings.register_profile("ci", max_examples=40, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TOL = {torch.float64: dict(atol=1e-9, rtol=1e-7), torch.float32: dict(atol=3e-5, rtol=3e-4)}


@st.composite
def attention_case(draw):
    b, h = draw(st.integers(0, 3)), draw(st.integers(1, 3))
    lq, lk = draw(st.integers(0, 70)), draw(st.integers(0, 70))
    d_k, d_v = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**31 - 1))
    mask_kind = draw(st.sampled_from(["none", "padding", "full", "2d", "stride0", "rows-fully-masked"]))
    mask_dtype = draw(st.sampled_from([torch.bool, torch.int32, torch.float32]))
    return dict(b=b, h=h, lq=lq, lk=lk, d_k=d_k, d_v=d_v, dtype=dtype, seed=seed, mask_kind=mask_kind,
                mask_dtype=mask_dtype, layout=draw(st.sampled_from(["contiguous", "transposed storage", "every other element"])),
                is_causal=draw(st.booleans()), need_weights=draw(st.booleans()))


def make_mask(c, g):
    b, h, lq, lk = c["b"], c["h"], c["lq"], c["lk"]
    kind = c["mask_kind"]
    if kind == "none":
        return None
    if kind == "padding":
        m = torch.rand(b, 1, 1, lk, generator=g) > 0.3
    elif kind == "full":
        m = torch.rand(b, h, lq, lk, generator=g) > 0.3
    elif kind == "2d":
        m = torch.rand(lq, lk, generator=g) > 0.3
    elif kind == "stride0":
        m = (torch.rand(1, 1, 1, lk, generator=g) > 0.3).expand(b, h, lq, lk)
    else:  # whole rows masked out
        m = (torch.rand(lq, 1, generator=g) > 0.5).expand(lq, lk)
    return m.to(c["mask_dtype"])


@given(attention_case())
def test_attention_core_matches_oracle(c):
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["b"], c["h"], c["lq"], c["d_k"], generator=g, dtype=c["dtype"])
    k = torch.randn(c["b"], c["h"], c["lk"], c["d_k"], generator=g, dtype=c["dtype"])
    v = torch.randn(c["b"], c["h"], c["lk"], c["d_v"], generator=g, dtype=c["dtype"])
    q, k, v = (relaid(t, c["layout"]).requires_grad_(True) for t in (q, k, v))
    mask = make_mask(c, g)
    out, weights = torch.ops.fastmha.attention(q, k, v, mask, 0.0, c["need_weights"], c["is_causal"])
    effective = mask
    if c["is_causal"]:
        causal = torch.tril(torch.ones(c["lq"], c["lk"], dtype=torch.bool))
        effective = causal if mask is None else (mask != 0) & causal
    ref_out, ref_weights = oracle_attention(q.double(), k.double(), v.double(), effective)
    tol = TOL[c["dtype"]]
    torch.testing.assert_close(out.double(), ref_out, **tol)
    if c["need_weights"]:
        torch.testing.assert_close(weights.double(), ref_weights, **tol)
    if out.numel() == 0:
        return
    grad = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad, allow_unused=True)
    ref = torch.autograd.grad(ref_out, (q, k, v), grad.double(), allow_unused=True)
    for got, want in zip(grads, ref):
        if want is None:
            continue
        torch.testing.assert_close(got.double(), want.double(), **{key: 10 * val for key, val in tol.items()})


@given(b=st.integers(0, 3), lq=st.integers(0, 20), lk=st.integers(1, 20), heads=st.sampled_from([1, 2, 4]),
       d_k=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_block_matches_oracle_block(b, lq, lk, heads, d_k, seed):
    torch.manual_seed(seed)
    d_model = heads * d_k
    block = fastmha.MultiHeadAttentionBlock(d_model, heads, 0.0).double()
    oracle = OracleBlock(d_model, heads).double()
    oracle.load_state_dict(block.state_dict())
    q = torch.randn(b, lq, d_model, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(b, lk, d_model, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(b, 1, 1, lk) > 0.25
    out = block(q, kv, kv, mask)
    ref_out, ref_weights = oracle(q, kv, kv, mask)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(block.attention_scores, ref_weights)
    if out.numel():
        grads = torch.autograd.grad(out.sum(), (q, kv, block.w_q.weight))
        ref = torch.autograd.grad(ref_out.sum(), (q, kv, oracle.w_q.weight))
        for got, want in zip(grads, ref):
            torch.testing.assert_close(got, want)
