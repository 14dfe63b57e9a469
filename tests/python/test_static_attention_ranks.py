"""The static attention method on inputs of rank 2, 3 and 5, which the textbook method's matmuls take: results,
gradients and dropout against the oracle on the same shapes, and errors in the caller's shapes."""

import pytest
import torch
from torch import nn

import fastmha
from oracle import oracle_attention

attention = fastmha.MultiHeadAttentionBlock.attention

# (leading dims, mask shape or None): masks of every rank up to the scores', broadcast or full.
CASES = {
    "rank 2": ([], None),
    "rank 2 mask": ([], (5, 7)),
    "rank 2 key mask": ([], (7,)),
    "rank 3": ([3], None),
    "rank 3 padding": ([3], (3, 1, 7)),
    "rank 3 full mask": ([3], (3, 5, 7)),
    "rank 3 shared mask": ([3], (5, 7)),
    "rank 5": ([2, 3, 2], None),
    "rank 5 per-batch mask": ([2, 3, 2], (3, 1, 5, 7)),
    "rank 5 broadcast mask": ([2, 3, 2], (1, 1, 1, 7)),
    "rank 5 full mask": ([2, 3, 2], (2, 3, 2, 5, 7)),
    "rank 5 rank-3 mask": ([2, 3, 2], (2, 5, 7)),
    "rank 5 rank-3 padding": ([2, 3, 2], (2, 1, 7)),
}


def make(lead, mask_shape, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(*lead, 5, 4, dtype=dtype)
    k = torch.randn(*lead, 7, 4, dtype=dtype)
    v = torch.randn(*lead, 7, 6, dtype=dtype)
    mask = None
    if mask_shape is not None:
        mask = (torch.rand(mask_shape) > 0.4).to(torch.int64)
        # A query row, or a whole padded batch entry, with no visible key: uniform over every key.
        if mask.dim() >= 2 and mask.shape[-2] > 1:
            mask[..., 0, :] = 0
        elif mask.dim() >= 3:
            mask[0] = 0
    return q, k, v, mask


@pytest.mark.parametrize("case", CASES)
def test_any_rank_matches_the_oracle(case):
    q, k, v, mask = make(*CASES[case])
    originals = [t.clone() for t in (q, k, v)] + ([] if mask is None else [mask.clone()])
    out, weights = attention(q, k, v, mask, None)
    expected_out, expected_weights = oracle_attention(q, k, v, mask)
    assert out.shape == expected_out.shape and weights.shape == expected_weights.shape
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)
    for before, after in zip(originals, (q, k, v, mask)):
        assert torch.equal(before, after)  # nothing the caller passed is modified


@pytest.mark.parametrize("case", ["rank 2 mask", "rank 3 padding", "rank 5 per-batch mask"])
def test_any_rank_gradients_match_the_oracle(case):
    assert_gradients_match_the_oracle(*make(*CASES[case]))


def assert_gradients_match_the_oracle(q, k, v, mask):
    grads = []
    for fn in (lambda *a: attention(*a, mask, None), lambda *a: oracle_attention(*a, mask)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, weights = fn(*inputs)
        (out.sin().sum() + (weights * weights).sum()).backward()
        grads.append([t.grad for t in inputs])
    for got, expected, t in zip(*grads, (q, k, v)):
        assert got.shape == t.shape  # summed over any dims it was broadcast along
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_rank_in_lower_precision(dtype):
    q, k, v, mask = make([3], (3, 1, 7), dtype=dtype)
    out, weights = attention(q, k, v, mask, None)
    expected_out, expected_weights = oracle_attention(q.double(), k.double(), v.double(), mask)
    assert out.dtype == dtype and weights.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected_out, atol=tol, rtol=tol)
    torch.testing.assert_close(weights.double(), expected_weights, atol=tol, rtol=tol)


def test_any_rank_with_dropout_in_training():
    q, k, v, mask = make([3], (3, 1, 7))
    out, weights = attention(q, k, v, mask, nn.Dropout(0.5).train())
    _, probs = oracle_attention(q, k, v, mask)
    kept = weights != 0
    assert 0 < kept.sum() < kept.numel()  # some dropped, some kept
    torch.testing.assert_close(weights[kept], probs[kept] / 0.5)
    torch.testing.assert_close(out, weights @ v)  # the values are weighted by the dropped weights
    eval_out, eval_weights = attention(q, k, v, mask, nn.Dropout(0.5).eval())
    torch.testing.assert_close(eval_weights, probs)


class Doubling(nn.Module):
    def forward(self, x):
        return x * 2.0


def test_any_rank_calls_a_dropout_module_of_the_users():
    q, k, v, mask = make([2, 3, 2], (3, 1, 5, 7))
    out, weights = attention(q, k, v, mask, Doubling())
    _, probs = oracle_attention(q, k, v, mask)
    torch.testing.assert_close(weights, probs * 2.0)
    torch.testing.assert_close(out, (probs * 2.0) @ v)


BAD = {
    "rank 1": (dict(q=torch.randn(4)), r"at least 2 dims \(\.\.\., L, d\), got query \[4\]"),
    "key rank 1": (dict(k=torch.randn(4)), r"at least 2 dims .* key \[4\]"),
    "key's leading dims": (dict(k=torch.randn(2, 7, 4)), r"leading dims \(all but the last two\) of query, key and value must broadcast, got query \[3, 5, 4\], key \[2, 7, 4\]"),
    "value's leading dims": (dict(v=torch.randn(2, 7, 6)), r"must broadcast, got query \[3, 5, 4\], key \[3, 7, 4\], value \[2, 7, 6\]"),
    "mask grows the scores": (dict(k=torch.randn(7, 4), v=torch.randn(7, 6), q=torch.randn(5, 4), mask=torch.ones(3, 5, 7)), r"mask of shape \[3, 5, 7\] does not broadcast to the scores \(\.\.\., Lq, Lk\) \[5, 7\]"),
    "d_k": (dict(k=torch.randn(3, 7, 5)), r"key must have the query's head size d_k \(last dim, positive\), got query \[3, 5, 4\], key \[3, 7, 5\]"),
    "zero d_k": (dict(q=torch.randn(3, 5, 0), k=torch.randn(3, 7, 0)), r"head size d_k \(last dim, positive\)"),
    "lengths": (dict(v=torch.randn(3, 6, 6)), r"key and value must have the same length \(dim -2\), got .* value \[3, 6, 6\]"),
    "mask": (dict(mask=torch.ones(3, 5, 6)), r"mask of shape \[3, 5, 6\] does not broadcast to the scores \(\.\.\., Lq, Lk\) \[3, 5, 7\]"),
    "mask rank": (dict(mask=torch.ones(1, 3, 5, 7)), r"mask of shape \[1, 3, 5, 7\] does not broadcast"),
    "complex mask": (dict(mask=torch.ones(7, dtype=torch.complex64)), r"mask must be a real or bool tensor"),
    "key dtype": (dict(k=torch.randn(3, 7, 4, dtype=torch.float64)), r"key must have the query's dtype Float, got Double"),
}


@pytest.mark.parametrize("case", BAD)
def test_any_rank_bad_inputs_are_named(case):
    changes, message = BAD[case]
    q = changes.get("q", torch.randn(3, 5, 4))
    k = changes.get("k", torch.randn(3, 7, 4))
    v = changes.get("v", torch.randn(3, 7, 6))
    with pytest.raises(RuntimeError, match=message):
        attention(q, k, v, changes.get("mask"), None)


class ShapeRecorder(nn.Module):
    """A dropout module of the user's that sees the weights in the caller's rank (nn.Dropout1d takes 2-D or 3-D)."""

    def __init__(self):
        super().__init__()
        self.shapes = []
        self.inner = nn.Dropout1d(0.0)

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.inner(x)


def test_any_rank_dropout_module_sees_the_callers_rank():
    q, k, v, mask = make([3], (3, 1, 7))
    recorder = ShapeRecorder()
    out, weights = attention(q, k, v, mask, recorder)
    assert recorder.shapes == [(3, 5, 7)]
    expected_out, expected_weights = oracle_attention(q, k, v, mask)
    torch.testing.assert_close(weights, expected_weights)
    torch.testing.assert_close(out, expected_out)


def test_sparse_input_of_another_rank_is_named():
    q = torch.randn(3, 5, 4)
    with pytest.raises(RuntimeError, match=r"key must be a dense \(strided\) tensor"):
        attention(q, torch.randn(3, 7, 4).to_sparse(), torch.randn(3, 7, 6), None, None)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_input_of_another_rank_is_named():
    nested = torch.nested.nested_tensor([torch.randn(5, 4), torch.randn(6, 4)])
    with pytest.raises(RuntimeError, match=r"query must be a dense \(strided\) tensor"):
        attention(nested, nested, nested, None, None)


# Leading dims that differ and broadcast, as the textbook's matmuls broadcast them: (query's, key's, value's leading
# dims, mask shape or None). The weights take the query's and key's broadcast dims; the output also the value's.
BROADCASTS = {
    "keys shared by the heads": ([2, 4], [2, 1], [2, 1], (2, 1, 1, 7)),
    "one memory for a batch": ([3, 4], [1, 4], [1, 4], None),
    "queries of batch 1": ([1, 4], [3, 4], [3, 4], (3, 1, 5, 7)),
    "rank-3 keys under rank-4 queries": ([2, 3], [3], [3], (3, 1, 7)),
    "rank-2 keys and values": ([2, 3], [], [], (5, 7)),
    "rank-3 queries": ([3], [2, 3], [2, 3], None),
    "rank 5": ([2, 1, 2], [3, 1], [1], (3, 1, 5, 7)),
    "values wider than the weights": ([1, 4], [1, 4], [3, 4], (1, 1, 1, 7)),
    "values wider, rank 3": ([], [], [3], None),
}


def make_broadcast(q_lead, k_lead, v_lead, mask_shape, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(*q_lead, 5, 4, dtype=dtype)
    k = torch.randn(*k_lead, 7, 4, dtype=dtype)
    v = torch.randn(*v_lead, 7, 6, dtype=dtype)
    mask = None if mask_shape is None else (torch.rand(mask_shape) > 0.4).to(torch.int64)
    if mask is not None:
        mask[..., 0] = 0
        mask[..., -1] = 1  # a visible key in every row
    return q, k, v, mask


@pytest.mark.parametrize("case", BROADCASTS)
def test_broadcast_leading_dims_match_the_oracle(case):
    q, k, v, mask = make_broadcast(*BROADCASTS[case])
    originals = [t.clone() for t in (q, k, v)]
    out, weights = attention(q, k, v, mask, None)
    expected_out, expected_weights = oracle_attention(q, k, v, mask)
    assert out.shape == expected_out.shape and weights.shape == expected_weights.shape
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)
    for before, after in zip(originals, (q, k, v)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("case", BROADCASTS)
def test_broadcast_leading_dims_gradients_match_the_oracle(case):
    assert_gradients_match_the_oracle(*make_broadcast(*BROADCASTS[case]))


@pytest.mark.parametrize("case", ["keys shared by the heads", "values wider than the weights"])
def test_broadcast_leading_dims_with_dropout(case):
    q, k, v, mask = make_broadcast(*BROADCASTS[case])
    out, weights = attention(q, k, v, mask, nn.Dropout(0.5).train())
    _, probs = oracle_attention(q, k, v, mask)
    assert weights.shape == probs.shape  # one dropout draw per weight, shared by the values it broadcasts over
    kept = weights != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(weights[kept], probs[kept] / 0.5)
    torch.testing.assert_close(out, weights @ v)
    recorder = ShapeRecorder()
    recorder.inner = nn.Identity()
    out, weights = attention(q, k, v, mask, recorder)
    assert recorder.shapes == [tuple(probs.shape)]  # a user's module sees the textbook's weights
    torch.testing.assert_close(out, probs @ v)
    dropped_out, dropped = attention(q, k, v, mask, nn.Dropout(1.0).train())
    assert not dropped.any() and not dropped_out.any()
