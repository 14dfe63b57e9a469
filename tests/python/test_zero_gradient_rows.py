"""The block's backward on padded batches, where many rows of the projections' gradients are exactly zero (a loss
that ignores padded positions, keys that no query sees), against autograd through the oracle: the same
gradients, and NaN exactly where the math has 0 * inf."""

import pytest
import torch
from conftest import TOLERANCES
from oracle import OracleBlock

import fastmha

D_MODEL, HEADS = 8, 2
KEPT_QUERIES = [3, 2]  # per sentence; the other query positions are padding the loss ignores
SEEN_KEYS = [2, 3]  # per sentence; the other keys are masked for every query


def padded_batch(dtype, device, len_q=8, len_k=8, d_model=D_MODEL):
    q = torch.randn(2, len_q, d_model, dtype=dtype, device=device)
    k = torch.randn(2, len_k, d_model, dtype=dtype, device=device)
    v = torch.randn(2, len_k, d_model, dtype=dtype, device=device)
    mask = (torch.arange(len_k, device=device)[None, :] < torch.tensor(SEEN_KEYS, device=device)[:, None])
    kept = (torch.arange(len_q, device=device)[None, :] < torch.tensor(KEPT_QUERIES, device=device)[:, None])
    # A weighted sum over the kept positions: a row of the output's gradient is zero exactly at padding.
    loss_weights = torch.randn(2, len_q, d_model, dtype=dtype, device=device) * kept[..., None]
    return q, k, v, mask[:, None, None, :].to(torch.int64), loss_weights


def gradients(block, q, k, v, mask, loss_weights):
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = block(*inputs, mask)
    if isinstance(out, tuple):
        out = out[0]
    (out * loss_weights).sum().backward()
    params = [block.w_q.weight, block.w_k.weight, block.w_v.weight, block.w_o.weight]
    return [t.grad for t in inputs] + [p.grad for p in params]


def blocks(dtype, device, d_model=D_MODEL):
    block = fastmha.MultiHeadAttentionBlock(d_model, HEADS, 0.0).to(device, dtype)
    oracle = OracleBlock(d_model, HEADS).to(device, torch.float64)
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    return block, oracle


def assert_gradients_match_with_nan(got, want, dtype):
    """The block's gradients against the oracle's, NaN at the same places."""
    names = ["query", "key", "value", "w_q", "w_k", "w_v", "w_o"]
    for name, g, w in zip(names, got, want):
        assert torch.equal(g.isnan(), w.isnan()), f"grad of {name}: NaN at other places than the oracle's"
        torch.testing.assert_close(g.double(), w, **TOLERANCES[dtype], equal_nan=True,
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_padded_batch_gradients_match_oracle(device, dtype):
    block, oracle = blocks(dtype, device)
    q, k, v, mask, loss_weights = padded_batch(dtype, device)
    got = gradients(block, q, k, v, mask, loss_weights)
    want = gradients(oracle, q.double(), k.double(), v.double(), mask, loss_weights.double())
    names = ["query", "key", "value", "w_q", "w_k", "w_v", "w_o"]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g.double(), w, **TOLERANCES[dtype], msg=lambda m: f"grad of {name}: {m}")
    # Padded query rows and unseen key rows have no gradient at all.
    for b in range(2):
        assert (got[0][b, KEPT_QUERIES[b]:] == 0).all()
        assert (got[1][b, SEEN_KEYS[b]:] == 0).all() and (got[2][b, SEEN_KEYS[b]:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("where", ["unseen key", "unseen value", "padded query", "w_v"])
def test_infinity_behind_a_zero_gradient_row_gives_nan_as_the_math_does(device, dtype, where):
    """0 * inf is NaN: a zero row of a projection's gradient times an infinite input row (in dW) or an infinite
    weight (in the input's gradient) makes the same NaNs as autograd through the oracle."""
    block, oracle = blocks(dtype, device)
    q, k, v, mask, loss_weights = padded_batch(dtype, device)
    if where == "unseen key":
        k[0, -1, 3] = float("inf")
    elif where == "unseen value":
        v[1, -1, 5] = float("-inf")
    elif where == "padded query":
        q[0, -1, 2] = float("inf")
    else:
        with torch.no_grad():
            block.w_v.weight[1, 4] = float("inf")
            oracle.w_v.weight[1, 4] = float("inf")
    got = gradients(block, q, k, v, mask, loss_weights)
    want = gradients(oracle, q.double(), k.double(), v.double(), mask, loss_weights.double())
    assert any(w.isnan().any() for w in want)  # the case makes NaN in the math
    assert_gradients_match_with_nan(got, want, dtype)


def test_tiny_float64_gradients_are_not_taken_for_zero(device):
    """Gradients of 1e-300 are zero in float32 but not in float64: the rows that carry them still count."""
    block, oracle = blocks(torch.float64, device)
    q, k, v, mask, loss_weights = padded_batch(torch.float64, device)
    got = gradients(block, q, k, v, mask, loss_weights * 1e-300)
    want = gradients(oracle, q, k, v, mask, loss_weights * 1e-300)
    for g, w in zip(got, want):
        assert torch.equal(g == 0, w == 0)
        torch.testing.assert_close(g * 1e300, w * 1e300, **TOLERANCES[torch.float64])


def test_empty_batch_and_expanded_zero_gradient(device):
    block, _ = blocks(torch.float32, device)
    q, k, v, mask, _ = padded_batch(torch.float32, device)
    empty = [t[:0].detach().requires_grad_(True) for t in (q, k, v)]
    block(*empty, mask[:0]).sum().backward()
    assert [t.grad.shape for t in empty] == [t.shape for t in empty]
    assert all((p.grad == 0).all() for p in block.parameters())
    # out.sum() * 0 sends an expanded (stride 0) gradient of zeros.
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    (block(*inputs, mask).sum() * 0).backward()
    assert all((t.grad == 0).all() for t in inputs)


def test_no_output_gradient_gives_zero_gradients(device):
    block, _ = blocks(torch.float32, device)
    q, k, v, mask, _ = padded_batch(torch.float32, device)
    for g in gradients(block, q, k, v, mask, torch.zeros(2, 8, D_MODEL, device=device)):
        assert (g == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("infinity", [None, "query", "key", "value"])
def test_attention_core_over_query_rows_without_gradient(device, dtype, infinity):
    """The attention core's backward with the output's gradient zero beyond the first queries (whole chunks of
    rows): the same gradients as autograd through the oracle, NaN included where an infinity meets a zero."""
    from oracle import oracle_attention

    q = torch.randn(1, 2, 200, 8, dtype=dtype, device=device)
    k, v = (torch.randn(1, 2, 16, 8, dtype=dtype, device=device) for _ in range(2))
    if infinity == "query":
        q[0, 1, 150, 3] = float("inf")  # in a row without gradient
    elif infinity == "key":
        k[0, 0, 7, 2] = float("inf")
    elif infinity == "value":
        v[0, 1, 4, 5] = float("-inf")
    loss_weights = torch.randn(1, 2, 200, 8, dtype=dtype, device=device)
    loss_weights[:, :, 10:] = 0
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    (torch.ops.fastmha.attention(*leaves, None, 0.0, False)[0] * loss_weights).sum().backward()
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    (oracle_attention(*ref_leaves)[0] * loss_weights.double()).sum().backward()
    # torch's fused CUDA kernels, which run this call there, turn the whole gradient row of a query that meets an
    # infinite key into NaN (the math has NaN only in that key's column): NaN may spread there, never vanish.
    spreads = device == "cuda" and infinity == "key"
    for name, got, want in zip("qkv", leaves, ref_leaves):
        got_nan, want_nan = got.grad.isnan(), want.grad.isnan()
        if spreads:
            assert (got_nan | ~want_nan).all(), f"grad of {name}: finite where the oracle has NaN"
            finite = ~got_nan
            torch.testing.assert_close(got.grad.double()[finite], want.grad[finite], **TOLERANCES[dtype],
                                       msg=lambda m: f"grad of {name}: {m}")
            continue
        assert torch.equal(got_nan, want_nan), f"grad of {name}: NaN elsewhere than the oracle's"
        torch.testing.assert_close(got.grad.double(), want.grad, **TOLERANCES[dtype], equal_nan=True,
                                   msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_model", [D_MODEL, 136])  # 136: rows that span two 64-element steps of the scan and a tail
@pytest.mark.parametrize("case", ["late gradient", "late infinity", "late nan"])
def test_zero_row_scan_reads_the_whole_row(device, dtype, d_model, case):
    """The scan for zero gradient rows reads each row to its end: a padded position whose output gradient is nonzero
    only in its last feature still gets its products, and a zero row whose input row holds an infinity or a NaN
    only in its last features (an unseen key or value) gives the math's NaN; in every dtype, against autograd through
    the oracle."""
    block, oracle = blocks(dtype, device, d_model)
    q, k, v, mask, loss_weights = padded_batch(dtype, device, d_model=d_model)
    if case == "late gradient":
        loss_weights[0, -1, -1] = 1.5  # a padded position's gradient, nonzero in its last feature alone
    elif case == "late infinity":
        k[0, -1, -2] = float("inf")  # an unseen key: its projections' gradient rows are zero
    else:
        v[1, -1, -2] = float("nan")
    got = gradients(block, q, k, v, mask, loss_weights)
    want = gradients(oracle, q.double(), k.double(), v.double(), mask, loss_weights.double())
    assert case == "late gradient" or any(w.isnan().any() for w in want)
    assert_gradients_match_with_nan(got, want, dtype)
