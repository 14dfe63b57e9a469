"""Masks with holes inside the keys a chunk of queries spans (block-sparse masks: a sliding window with global
keys, packed documents, tiles hidden from every row). fastmha's CPU kernels skip the runs of keys that every row
of a chunk hides and read no mask where every row sees every key; the kernels that keep whole score rows give
such runs -1e9 without computing them. Skipping must change no number: each case runs against the float64
oracle, forward and backward, with and without kept weights, including the cases where the math still feels a
hidden key (rows with no visible key, scores at or below -1e9, NaN or infinite values).
"""

import pytest
import torch
from conftest import assert_attention_close, assert_close
from oracle import oracle_attention
from philox_reference import expected_keep

import fastmha

B, H, LQ, LK, D = 2, 2, 300, 520, 8


@pytest.fixture(params=["16", ""], ids=lambda b: f"block={b or 'auto'}")
def own_kernels(request, monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", request.param)


def window_with_global_keys(lq=LQ, lk=LK, width=40, global_keys=8):
    rows, cols = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    return ((cols - rows).abs() <= width) | (cols < global_keys)


def packed_documents(lq=LQ, lk=LK, lengths=(70, 200, 30, 220)):
    doc_q = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:lq]
    doc_k = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:lk]
    return doc_q[:, None] == doc_k[None, :]


def hidden_tiles(lq=LQ, lk=LK, tile=64):
    tiles = torch.rand((lq + tile - 1) // tile, (lk + tile - 1) // tile) > 0.6
    tiles[:, 0] = True  # every row sees some key
    return tiles.repeat_interleave(tile, 0).repeat_interleave(tile, 1)[:lq, :lk]


def mask_cases():
    per_batch = torch.stack([window_with_global_keys(), packed_documents()])[:, None]  # (B, 1, LQ, LK)
    transposed = hidden_tiles().t().contiguous().t()  # keys LQ apart in memory
    no_key_rows = window_with_global_keys().clone()
    no_key_rows[[0, 150, LQ - 1]] = False  # uniform over all keys (the -1e9 rule)
    return {
        "window and global keys": window_with_global_keys(),
        "packed documents": packed_documents().to(torch.int64),
        "hidden tiles": hidden_tiles(),
        "one mask per batch": per_batch,
        "transposed storage": transposed,
        "rows with no key": no_key_rows,
        "every fourth key": (torch.arange(LK) % 4 == 0).expand(LQ, LK),
        "every fortieth key": (torch.arange(LK) % 40 == 0).expand(LQ, LK),  # runs of one key between gaps
    }


def full_mask(mask, is_causal, shape):
    lq, lk = shape[2], shape[3]
    visible = torch.ones(shape, dtype=torch.bool) & (mask != 0)
    if is_causal:
        visible = visible & torch.ones(lq, lk, dtype=torch.bool).tril()
    return visible


def run_and_oracle(q, k, v, mask, is_causal, need_weights, dtype, grad):
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, weights = torch.ops.fastmha.attention(*inputs, mask, 0.0, need_weights, is_causal)
    got = torch.autograd.grad(out, inputs, grad.to(dtype))
    ref = [t.detach().to(dtype).double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref, full_mask(mask, is_causal, (*q.shape[:3], k.size(2))))
    want = torch.autograd.grad(ref_out, ref, grad.to(dtype).double())
    return (out, weights, got), (ref_out, ref_weights, want)


@pytest.mark.parametrize("case", list(mask_cases()))
@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_block_sparse_masks_match_the_oracle(own_kernels, case, need_weights, dtype):
    q, k, v = torch.randn(B, H, LQ, D), torch.randn(B, H, LK, D), torch.randn(B, H, LK, D)
    mask = mask_cases()[case]
    got, want = run_and_oracle(q, k, v, mask, False, need_weights, dtype, torch.randn(B, H, LQ, D))
    assert_attention_close(got, want, dtype, need_weights)


@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
def test_holes_with_causal_and_float16(own_kernels, need_weights):
    q, k, v = torch.randn(B, H, LQ, D), torch.randn(B, H, LK, D), torch.randn(B, H, LK, D)
    for case in ("window and global keys", "hidden tiles"):
        for is_causal, dtype in ((True, torch.float32), (False, torch.float16)):
            (out, _, got), (ref_out, _, want) = run_and_oracle(q, k, v, mask_cases()[case], is_causal, need_weights,
                                                               dtype, torch.randn(B, H, LQ, D))
            assert_close(out, ref_out, dtype)
            for g, w in zip(got, want):
                assert_close(g, w, dtype)


@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
def test_visible_scores_below_the_fill_give_the_hidden_keys_the_weight(own_kernels, need_weights):
    # Visible scores near -1e10 lie below the -1e9 of hidden keys: the math puts all weight on the hidden keys
    # (uniformly), so none of them may be skipped.
    mask = window_with_global_keys()
    q, k, v = torch.zeros(1, 1, LQ, D), torch.zeros(1, 1, LK, D), torch.randn(1, 1, LK, D)
    q[..., 0] = 1e5
    k[..., 0] = -1e5 * D**0.5
    grad = torch.randn(1, 1, LQ, D)
    for dtype in (torch.float64, torch.float32):
        (out, _, got), (ref_out, _, want) = run_and_oracle(q, k, v, mask, False, need_weights, dtype, grad)
        assert_close(out, ref_out, dtype)
        for g, w in zip(got, want):
            assert_close(g, w, dtype)


@pytest.mark.parametrize("where", ["value", "key", "output gradient"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
def test_non_finite_numbers_at_hidden_keys_propagate_like_the_math(own_kernels, need_weights, where):
    # A weight of exactly 0 times a NaN value is NaN, and so is a zero score gradient times an infinite key or
    # a zero weight times a NaN output gradient: the keys that every row hides must then be computed.
    mask = window_with_global_keys()
    q, k, v = (torch.randn(1, 1, n, D, dtype=torch.float64) for n in (LQ, LK, LK))
    grad = torch.randn(1, 1, LQ, D, dtype=torch.float64)
    if where == "value":
        v[0, 0, 400, 3] = float("nan")  # no row sees key 400
    elif where == "key":
        k[0, 0, 200, 1] = float("inf")  # only rows 160..240 see key 200
    else:
        grad[0, 0, 10, 2] = float("nan")
    (out, _, got), (ref_out, _, want) = run_and_oracle(q, k, v, mask, False, need_weights, torch.float64, grad)
    assert any(t.isnan().any() for t in (ref_out, *want))
    for g, w in zip((out, *got), (ref_out, *want)):
        assert torch.equal(g.isnan(), w.isnan())
        torch.testing.assert_close(g.nan_to_num(), w.nan_to_num())


def test_dropout_with_holes(own_kernels):
    mask = packed_documents()
    q, k, v = (torch.randn(1, 2, n, D, dtype=torch.float64, requires_grad=True) for n in (LQ, LK, LK))
    torch.manual_seed(3)
    out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.2, False, False)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    torch.manual_seed(3)
    _, _, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, mask, 0.2, False, False)
    seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
    keep = expected_keep(seed, offset, (1, 2, LQ, LK), 0.2)
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref, mask, keep, 0.2)
    assert_close(out, ref_out, torch.float64)
    for g, w in zip(got, torch.autograd.grad(ref_out, ref, grad)):
        assert_close(g, w, torch.float64)


def forward_choice(mask, lq=1024, lk=1024):
    q, k, v = (torch.randn(1, 2, n, 64, dtype=torch.float64) for n in (lq, lk, lk))
    line = fastmha.explain(q, k, v, mask, need_weights=False).splitlines()[0]
    return line.split(":")[0].split()[1], line


def test_kernel_choice_counts_the_keys_inside_the_span_that_are_skipped():
    # The rule for a float64 forward (float32's takes fastmha's kernel beyond 512 keys without a mask too, at any
    # number of query rows on AVX-512, from 1024 with its P V on brgemm without it).
    # Each of these masks spans nearly all keys from a chunk's first to its last visible one, but leaves a
    # small share of them to compute: fastmha's kernel skips the rest, torch's computes all.
    window = window_with_global_keys(1024, 1024, width=32, global_keys=16)
    kernel, line = forward_choice(window)
    assert kernel == "fastmha-cpu" and "keys to compute" in line, line
    share = line.split("leaves ")[1].split("%")[0]
    for other_dtype in (window.to(torch.int64), window * 0.5):  # only exact zeros mask
        assert forward_choice(other_dtype)[1] == line
    assert int(share) < 30, line  # a chunk of 64 rows computes about 16 + 64 + 2 * 32 of 1024 keys
    kernel, line = forward_choice(packed_documents(1024, 1024, lengths=(100,) * 10 + (24,)))
    assert kernel == "fastmha-cpu", line
    kernel, line = forward_choice(torch.ones(1024, 1024, dtype=torch.bool))
    assert kernel == "torch-cpu-flash", line


@pytest.mark.parametrize("scores", ["normal", "below the fill"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradient_through_the_kept_weights(own_kernels, scores, dtype):
    # A loss on the weights themselves takes the whole-row backward (its own dS over rows of scores).
    mask = window_with_global_keys()
    q, k, v = torch.randn(1, 2, LQ, D), torch.randn(1, 2, LK, D), torch.randn(1, 2, LK, D)
    if scores == "below the fill":
        q[..., 0], k[..., 0] = 1e5, -1e5 * D**0.5
    grad_out, grad_weights = torch.randn(1, 2, LQ, D), torch.randn(1, 2, LQ, LK)
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, weights = torch.ops.fastmha.attention(*inputs, mask, 0.0, True, False)
    got = torch.autograd.grad((out, weights), inputs, (grad_out.to(dtype), grad_weights.to(dtype)))
    ref = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref, mask)
    want = torch.autograd.grad((ref_out, ref_weights), ref, (grad_out.double(), grad_weights.double()))
    assert_close(weights, ref_weights, dtype)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)


def test_float32_backward_past_2048_keys_says_when_a_mask_skips_keys():
    q, k, v = (torch.randn(1, 1, 4096, 64) for _ in range(3))
    causal = torch.ones(4096, 4096, dtype=torch.bool).tril()  # about half the keys computed
    backward = fastmha.explain(q, k, v, causal, need_weights=False).splitlines()[1]
    assert backward.startswith("backward fastmha-cpu: a mask that leaves"), backward
    backward = fastmha.explain(q, k, v, None, need_weights=False).splitlines()[1]
    assert backward.startswith("backward fastmha-cpu: fastmha's backward is as fast"), backward
