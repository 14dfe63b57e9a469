"""A bfloat16 or float16 forward whose products run in fp32 widens q, k and v a head at a time in its tasks and
rounds each chunk's output rows into the half-type output; the blocked backward widens dO and O rows too and
rounds its dQ rows. Each task must read the rows of its own head and chunk
whatever the layout of the inputs, the threads' order through the heads and the kernel path (online softmax,
kept weights, a chunk redone over all keys), so outputs are checked against the float64 oracle and, sharper,
against the float32 kernel on the same values rounded once to the half type.
"""

import pytest
import torch

from conftest import assert_close
from layouts import contiguous, heads_interleaved, strided_rows
from oracle import oracle_attention

OPS = torch.ops.fastmha
HALF_TYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def widened_products(monkeypatch):
    """The widened path on every CPU: by default, CPUs with native half-type products multiply long rows in the
    half type instead (test_half_products.py)."""
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "widen")


def make(layout, b, h, length, d, dtype):
    return {"contiguous": contiguous, "heads interleaved": heads_interleaved, "strided rows": strided_rows}[layout](
        b, h, length, d, dtype)


def padding_mask(b, len_q, len_k, kept, causal):
    keys = torch.arange(len_k) < torch.tensor(kept)[:, None]
    mask = keys[:, None, None, :]
    if causal:
        mask = mask & torch.ones(len_q, len_k, dtype=torch.bool).tril()
    return mask.to(torch.int64)


# (B, H, Lq, Lk, d_k, d_v): two heads on two threads take one chunk at a time; 32 heads a head's chunks at a time.
SHAPES = {"few heads": (1, 2, 300, 260, 16, 24), "many heads": (4, 8, 45, 70, 32, 32)}
MASKS = ["none", "padding", "padding & causal", "every key hidden for some rows"]


def mask_for(kind, b, len_q, len_k):
    kept = [len_k // 3 + 7 * i for i in range(b)]
    if kind == "none":
        return None
    if kind == "padding":
        return padding_mask(b, len_q, len_k, kept, False)
    if kind == "padding & causal":
        return padding_mask(b, len_q, len_k, kept, True)
    mask = padding_mask(b, len_q, len_k, kept, True)
    mask[:, :, ::5] = 0  # rows with no visible key: uniform over all keys, the chunk takes every key
    return mask


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("layout", ["contiguous", "heads interleaved", "strided rows"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("need_weights", [False, True])
def test_widened_in_tasks_matches_the_oracle_and_float32(monkeypatch, dtype, layout, shape, mask_kind, need_weights):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")  # not torch's flash kernel, which multiplies in the half type
    check_against_oracle_and_float32(dtype, layout, SHAPES[shape], mask_kind, need_weights)


def assert_float32_rounded_once(out, out32):
    """The float32 kernel on the same values, rounded once: at most one unit in the last place of the half type."""
    torch.testing.assert_close(out.float(), out32.to(out.dtype).float(), atol=1e-6,
                               rtol=2 ** -7 if out.dtype == torch.bfloat16 else 2 ** -10)


def check_against_oracle_and_float32(dtype, layout, shape, mask_kind, need_weights):
    b, h, len_q, len_k, d_k, d_v = shape
    q, k = make(layout, b, h, len_q, d_k, dtype), make(layout, b, h, len_k, d_k, dtype)
    v = make(layout, b, h, len_k, d_v, dtype)
    mask = mask_for(mask_kind, b, len_q, len_k)
    copies = [t.clone() for t in (q, k, v)]
    out, weights = OPS.attention(q, k, v, mask, 0.0, need_weights, False)
    assert out.dtype == dtype and out.shape == (b, h, len_q, d_v)
    ref_out, ref_weights = oracle_attention(q.double(), k.double(), v.double(), mask)
    assert_close(out, ref_out, dtype)
    if need_weights:
        assert_close(weights, ref_weights, dtype)
    out32, _ = OPS.attention(q.float(), k.float(), v.float(), mask, 0.0, need_weights, False)
    assert_float32_rounded_once(out, out32)
    for t, copy in zip((q, k, v), copies):
        assert torch.equal(t, copy)


# (B, H, Lq, Lk, d): short rows; rows whose length is not a multiple of 16 values (row starts off 32-byte
# boundaries); weights of 16 MiB and more in the half type, which the tasks stream to memory.
KEPT_WEIGHT_SHAPES = {"short rows": (2, 3, 40, 37, 16), "odd rows": (1, 2, 130, 1031, 16),
                      "streamed": (2, 4, 1031, 1031, 16)}


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("shape", list(KEPT_WEIGHT_SHAPES))
@pytest.mark.parametrize("mask_kind", ["none", "padding & causal"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_kept_half_weights_are_the_float32_weights_rounded_once(monkeypatch, dtype, shape, mask_kind, dropout_p):
    # The tasks round each weight row from float32 into the half-type weights: the same bits as rounding the
    # float32 kernel's weights for the same values (and the same dropout draw), zeros included.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    b, h, len_q, len_k, d = KEPT_WEIGHT_SHAPES[shape]
    q, k = torch.randn(b, h, len_q, d, dtype=dtype), torch.randn(b, h, len_k, d, dtype=dtype)
    v = torch.randn(b, h, len_k, d, dtype=dtype)
    mask = mask_for(mask_kind, b, len_q, len_k)
    torch.manual_seed(7)
    out, weights = OPS.attention(q, k, v, mask, dropout_p, True, False)
    torch.manual_seed(7)
    out32, weights32 = OPS.attention(q.float(), k.float(), v.float(), mask, dropout_p, True, False)
    assert weights.dtype == dtype and weights.shape == (b, h, len_q, len_k)
    torch.testing.assert_close(weights, weights32.to(dtype), atol=0, rtol=0)
    if dropout_p == 0:
        _, ref_weights = oracle_attention(q.double(), k.double(), v.double(), mask)
        assert_close(weights, ref_weights, dtype)


# (B, H, Lq, Lk, d_k, d_v): one or two query rows per head (decoding steps), whose tasks read the keys and values
# in the half type as they are: head sizes that are not whole vectors (tails), one to four vectors of values in
# one pass, more keys than a key block.
FEW_ROWS_SHAPES = {"one row, tails": (2, 3, 1, 37, 37, 72), "two rows": (1, 4, 2, 1031, 64, 128),
                   "one row, one key": (3, 2, 1, 1, 8, 8), "wide values": (1, 2, 1, 300, 16, 160),
                   "one vector": (1, 2, 1, 40, 32, 32), "three vectors": (2, 2, 2, 50, 16, 96)}


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("layout", ["contiguous", "heads interleaved", "strided rows"])
@pytest.mark.parametrize("shape", list(FEW_ROWS_SHAPES))
@pytest.mark.parametrize("mask_kind", MASKS)
def test_few_query_rows_read_half_keys_and_values_as_they_are(monkeypatch, dtype, layout, shape, mask_kind):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    check_against_oracle_and_float32(dtype, layout, FEW_ROWS_SHAPES[shape], mask_kind, False)


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("len_q", [1, 2])
def test_few_query_rows_with_dropout_or_is_causal_match_float32(monkeypatch, dtype, len_q):
    # The same dropout draw as the float32 kernel on the same values (it draws by position), and is_causal's
    # hidden keys; the result at most one unit in the last place of the half type away.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    q, k, v = (torch.randn(2, 3, n, 24, dtype=dtype) for n in (len_q, 90, 90))
    for dropout_p, is_causal in ((0.25, False), (0.0, True)):
        torch.manual_seed(5)
        out, _ = OPS.attention(q, k, v, None, dropout_p, False, is_causal)
        torch.manual_seed(5)
        out32, _ = OPS.attention(q.float(), k.float(), v.float(), None, dropout_p, False, is_causal)
        assert_float32_rounded_once(out, out32)
    ref_out, _ = oracle_attention(q.double(), k.double(), v.double(), torch.ones(len_q, 90).tril().bool())
    assert_close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("len_q", [1, 2, 64])
def test_non_finite_value_behind_the_padding_reaches_every_row(monkeypatch, dtype, len_q):
    # A NaN value at a padded key: its weight is exactly 0 and 0 * NaN is NaN, so that column of every output row
    # of the head is NaN in the math; a task must scan its own head's widened values before skipping those keys.
    # One or two query rows read the values in the half type as they are.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    b, h, length, d = 2, 4, 64, 16
    q = torch.randn(b, h, len_q, d, dtype=dtype)
    k, v = (torch.randn(b, h, length, d, dtype=dtype) for _ in range(2))
    v[1, 2, 50, 3] = float("nan")
    mask = padding_mask(b, len_q, length, [20, 30], False)
    out, _ = OPS.attention(q, k, v, mask, 0.0, False, False)
    ref_out, _ = oracle_attention(q.double(), k.double(), v.double(), mask)
    assert torch.equal(out.isnan(), ref_out.isnan())
    assert out[1, 2, :, 3].isnan().all() and out.isnan().sum() == len_q
    finite = ~ref_out.isnan()
    assert_close(out[finite], ref_out[finite], dtype)


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("len_q,len_k,d_v", [(0, 5, 8), (5, 0, 8), (5, 6, 0)])
def test_empty_sequences_and_values(dtype, len_q, len_k, d_v):
    q, k = torch.randn(2, 3, len_q, 8, dtype=dtype), torch.randn(2, 3, len_k, 8, dtype=dtype)
    v = torch.randn(2, 3, len_k, d_v, dtype=dtype)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out, _ = OPS.attention(*inputs, None, 0.0, False, False)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref)
    assert out.shape == (2, 3, len_q, d_v) and out.dtype == dtype
    assert_close(out, ref_out, dtype)
    grad = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref_out, ref, grad.double())):
        assert g.dtype == dtype
        assert_close(g, r, dtype)


@pytest.mark.parametrize("dtype", HALF_TYPES)
@pytest.mark.parametrize("layout", ["contiguous", "heads interleaved", "strided rows"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mask_kind", MASKS)
def test_gradients_widened_in_tasks_match_the_oracle(monkeypatch, dtype, layout, shape, mask_kind):
    # The blocked backward widens q/k/v, dO and O in its tasks and rounds dQ there; two heads split their chunks
    # into ranges with partial dK and dV.
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    b, h, len_q, len_k, d_k, d_v = SHAPES[shape]
    q, k = make(layout, b, h, len_q, d_k, dtype), make(layout, b, h, len_k, d_k, dtype)
    v = make(layout, b, h, len_k, d_v, dtype)
    mask = mask_for(mask_kind, b, len_q, len_k)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = OPS.attention(*inputs, mask, 0.0, False, False)
    grad = make(layout, b, h, len_q, d_v, dtype)
    grads = torch.autograd.grad(out, inputs, grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle_attention(*ref, mask)
    ref_grads = torch.autograd.grad(ref_out, ref, grad.double())
    assert_close(out, ref_out, dtype)
    for g, r, t in zip(grads, ref_grads, inputs):
        assert g.dtype == dtype and g.shape == t.shape
        assert_close(g, r, dtype)


@pytest.mark.parametrize("layout", ["contiguous", "heads interleaved"])
def test_float16_output_that_overflows_late_in_memory_keeps_finite_gradients(layout):
    # With dropout a float16 output can round to inf; the backward then must not take D = dO . O from it. Here
    # only the last head of the last batch element overflows, beyond the first pieces of the output's scan.
    b, h, length, d = 2, 4, 300, 64
    q, k, v = (make(layout, b, h, length, d, torch.float16) * 0.1 for _ in range(3))
    v[-1, -1] = 62000.0  # a mean of 62000 over kept keys times 2: about 1 row in 6 passes 65504
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = OPS.attention(*inputs, None, 0.5, False, False)
    assert out[-1, -1].isinf().any() and out[:-1].isfinite().all() and out[-1, :-1].isfinite().all()
    grads = torch.autograd.grad(out, inputs, torch.randn_like(out) * 0.01)
    for g in grads:
        assert g.isfinite().all()
