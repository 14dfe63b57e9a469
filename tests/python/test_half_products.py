"""The CPU kernels' products in the half type itself (FASTMHA_CPU_HALF_GEMM): the forward's S = Q K^T and O = P V
and the blocked backward's dP = dO V^T, dV = W^T dO, dQ = dS K and dK = dS^T Q, with bfloat16 or float16
operands accumulated in fp32, the weights W and score gradients dS rounded to the half type.
`reference` takes this path through ATen's reference GEMM on any CPU, so these cases check the packing, the
zero padding of odd head sizes and the key skipping around the products against the float64 oracle; `native`
runs the same path on oneDNN's kernels where the CPU multiplies the half type itself, and is checked alike there.
"""

import re

import pytest
import torch
from conftest import assert_attention_close, assert_close, cpu_flags
from layouts import contiguous, heads_interleaved
from oracle import oracle_attention
from philox_reference import expected_keep

import fastmha

B, H, LQ, LK, D, DV = 2, 2, 90, 150, 24, 40  # head sizes that are not multiples of the products' depth of 64
HALF_TYPES = [torch.bfloat16, torch.float16]


def products_note(dtype):
    q = torch.randn(1, 1, 4, 8, dtype=dtype)
    return fastmha.explain(q, q, q, None, 0.0, True).splitlines()[0]


def native_products(dtype):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTMHA_CPU_HALF_GEMM", "native")
        return "own instructions" in products_note(dtype)


@pytest.fixture(params=["reference", "native"])
def half_products(request, monkeypatch):
    """The switch for a test parametrized by `dtype`."""
    dtype = request.node.callspec.params["dtype"]
    if request.param == "native" and not native_products(dtype):
        pytest.skip(f"this CPU has no native {dtype} products")
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", request.param)
    return request.param


def padding(lengths, lk=LK):
    return (torch.arange(lk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


def mask_cases():
    rows, cols = torch.arange(LQ)[:, None], torch.arange(LK)[None, :]
    window = ((cols - rows).abs() <= 12) | (cols < 4)  # runs of keys every row of a chunk hides
    no_key_rows = padding([LK, 30]).expand(B, 1, LQ, LK).clone()
    no_key_rows[1, 0, [0, 40, LQ - 1]] = False  # uniform over all keys (the -1e9 rule)
    runs_apart = torch.zeros(LQ, LK, dtype=torch.bool)  # one run of keys per row, 70 keys no row sees between
    runs_apart[: LQ // 2, 5:20] = True
    runs_apart[LQ // 2:, 90:130] = True
    return {
        "none": None,
        "padding 80%": padding([30, 20]),
        "window and global keys": window,
        "rows with no key": no_key_rows,
        "runs apart": runs_apart,
    }


def run_and_oracle(q, k, v, mask, need_weights, grad, dropout=(0.0, None)):
    p, keep = dropout
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out, weights = torch.ops.fastmha.attention(*inputs, mask, p, need_weights, False)
    got = torch.autograd.grad(out, inputs, grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref, mask, keep, p)
    want = torch.autograd.grad(ref_out, ref, grad.double())
    return (out, weights, got), (ref_out, ref_weights, want)


def half_inputs(dtype, lq=LQ, lk=LK):
    return (torch.randn(B, H, lq, D, dtype=dtype), torch.randn(B, H, lk, D, dtype=dtype),
            torch.randn(B, H, lk, DV, dtype=dtype), torch.randn(B, H, lq, DV, dtype=dtype))


@pytest.mark.parametrize("lq", [192, 1008], ids=["one chunk of 192 rows", "a last chunk of 240 rows"])
@pytest.mark.parametrize("layout", [contiguous, heads_interleaved], ids=["contiguous", "heads interleaved"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_query_rows_read_in_place_in_row_blocks_match_the_oracle(half_products, lq, layout, dtype):
    # A head size of 64 and chunks whose rows are a multiple of 16 but no power of two: the forward reads a chunk's
    # query rows in place and its products run in row blocks (192 = 128 + 64, 240 = 128 + 64 + 32 + 16); 16 heads
    # on 2 threads keep chunks of 256 rows.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = (layout(1, 16, length, 64, dtype) for length in (lq, 300, 300))
        grad = torch.randn(1, 16, lq, 64, dtype=dtype)
        got, want = run_and_oracle(q, k, v, None, False, grad)
    finally:
        torch.set_num_threads(threads)
    assert_attention_close(got, want, dtype, False)


@pytest.mark.parametrize("case", list(mask_cases()))
@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
@pytest.mark.parametrize("block", ["16", "64", ""], ids=["block=16", "block=64", "block=auto"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_half_type_products_match_the_oracle(half_products, monkeypatch, case, need_weights, block, dtype):
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    q, k, v, grad = half_inputs(dtype)
    mask = mask_cases()[case]
    got, want = run_and_oracle(q, k, v, mask, need_weights, grad)
    assert got[0].dtype == dtype
    assert_attention_close(got, want, dtype, need_weights)


@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
@pytest.mark.parametrize("block", ["64", "600"], ids=["block=64", "block=600"])
@pytest.mark.parametrize("length", [650, 100])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_large_heads_and_key_blocks(half_products, monkeypatch, need_weights, block, length, dtype):
    # Head sizes over one panel of 64 columns, packed once per head (blocks of 64 keys read them at every block),
    # and key blocks of 600: depths in two pieces of at most 512. With 100 of 700 keys visible the packs hold 100
    # keys, and the panels of their rows lie padded_depth(100) apart, not padded_depth(700).
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    q, k, v = (torch.randn(1, 2, n, d, dtype=dtype) for n, d in ((70, 80), (700, 80), (700, 130)))
    grad = torch.randn(1, 2, 70, 130, dtype=dtype)
    got, want = run_and_oracle(q, k, v, padding([length], lk=700), need_weights, grad)
    assert_attention_close(got, want, dtype, need_weights)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_operand_padding_is_zero_after_a_nan_backward(half_products, dtype):
    # The kernels' operand buffers are kept per thread: a backward whose score gradients were NaN (in the last head
    # it computes) leaves NaN in them, and a later forward over fewer keys must still pad its weights with zeros
    # (NaN times the zero rows of the padded values would be NaN).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q, k, v, grad = half_inputs(dtype, lk=100)
        q[-1, -1, 7] = float("nan")
        inputs = [t.requires_grad_() for t in (q, k, v)]
        torch.autograd.grad(torch.ops.fastmha.attention(*inputs, None, 0.0, False, False)[0], inputs, grad)
        q, k, v, grad = half_inputs(dtype, lk=20)
        got, want = run_and_oracle(q, k, v, None, False, grad)
        assert_attention_close(got, want, dtype, False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", [contiguous, heads_interleaved], ids=["contiguous", "heads interleaved"])
@pytest.mark.parametrize("lq", [256, 200])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_query_chunks_read_in_place(half_products, layout, lq, d, dtype):
    # Query chunks of a power of two of rows with a head size of whole depth multiples (64) are the left operand of
    # Q K^T read in place, through the rows' stride (the heads' interleaving): 256 queries make only such chunks,
    # 200 a last one that is padded.
    q, k, v, grad = (layout(2, 2, n, d, dtype) for n in (lq, 150, 150, lq))
    got, want = run_and_oracle(q, k, v, padding([150, 40]), False, grad)
    assert_attention_close(got, want, dtype, False)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_score_gradients_beyond_float16_range_before_their_scale(half_products, dtype):
    # Two equal keys share the weight; values +-1000 along one axis and an output gradient of 200 there give
    # score gradients of +-1e5, beyond float16's 65504, but scale * dS = 2e4 and every input gradient is finite.
    q = torch.zeros(1, 1, 1, D, dtype=dtype)
    q[..., 0] = 0.1
    k = torch.ones(1, 1, 2, D, dtype=dtype)
    v = torch.zeros(1, 1, 2, DV, dtype=dtype)
    v[0, 0, 0, 0], v[0, 0, 1, 0] = 1000, -1000
    grad = torch.zeros(1, 1, 1, DV, dtype=dtype)
    grad[..., 0] = 200
    got, want = run_and_oracle(q, k, v, None, False, grad)
    assert all(w.isfinite().all() for w in want[2]) and want[2][1].abs().max() > 2000
    for g, w in zip(got[2], want[2]):
        assert_close(g / 2000, w / 2000, dtype)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_the_half_type_path_runs_its_own_products(half_products, monkeypatch, dtype):
    assert ("reference GEMM" if half_products == "reference" else "own instructions") in products_note(dtype)
    q, k, v, grad = half_inputs(dtype, lq=64, lk=200)

    def forward_backward():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out, weights = torch.ops.fastmha.attention(*inputs, None, 0.0, True, False)
        return out, weights, torch.autograd.grad(out, inputs, grad)

    out, weights, grads = forward_backward()
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "widen")
    widened, widened_weights, widened_grads = forward_backward()
    # The weights come from the same fp32-accumulated scores; the output and the gradients differ where the
    # rounding of the weights and of the score gradients to the half type shows.
    assert_close(weights, widened_weights, dtype)
    for got, wide in zip((out, *grads), (widened, *widened_grads)):
        assert not torch.equal(got, wide)
        assert_close(got, wide, dtype)


@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_dropout_with_half_type_products(half_products, need_weights, dtype):
    q, k, v, grad = half_inputs(dtype)
    mask = padding([60, 150])
    torch.manual_seed(5)
    _, _, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, mask, 0.2, need_weights, False)
    seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
    keep = expected_keep(seed, offset, (B, H, LQ, LK), 0.2)
    torch.manual_seed(5)
    got, want = run_and_oracle(q, k, v, mask, need_weights, grad, (0.2, keep))
    assert_attention_close(got, want, dtype, need_weights)


@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
@pytest.mark.parametrize("block", ["64", ""], ids=["block=64", "block=auto"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_nan_value_at_a_hidden_key_propagates_like_the_math(half_products, monkeypatch, need_weights, block, dtype):
    # A zero weight times a NaN value is NaN: the key no row sees must still be multiplied, also where the heads'
    # packs stop at the last visible key (blocks of 64 keys read them).
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    q, k, v, grad = half_inputs(dtype)
    v[0, 1, 120, 5] = float("nan")
    mask = padding([100, 100])
    (out, _, _), (ref_out, _, _) = run_and_oracle(q, k, v, mask, need_weights, grad)
    assert ref_out.isnan().any()
    assert torch.equal(out.isnan(), ref_out.isnan())
    assert_close(out.nan_to_num(), ref_out.nan_to_num(), dtype)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_nan_in_a_query_row_reaches_the_gradients_like_the_math(half_products, dtype):
    # The backward reads the query rows in the half type for its skips. A NaN query row makes its output and dQ
    # rows NaN, and the dK and dV rows of its head, the padded keys' dK too (zero score gradients times NaN).
    q, k, v, grad = half_inputs(dtype)
    q[1, 0, 7, 3] = float("nan")
    (out, _, got), (ref_out, _, want) = run_and_oracle(q, k, v, padding([100, 60]), False, grad)
    assert want[1][1, 0, 140].isnan().any()
    for a, b in zip((out, *got), (ref_out, *want)):
        assert torch.equal(a.isnan(), b.isnan())
        assert_close(a.nan_to_num(), b.nan_to_num(), dtype)


@pytest.mark.parametrize("need_weights", [False, True], ids=["blocked", "kept weights"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_infinite_value_after_a_short_block_stays_infinite(half_products, monkeypatch, need_weights, dtype):
    # Keys 0..99 are a block whose depth is padded to 128 with zero weights: it must not read the values of keys
    # 100..127 (zero times infinity is NaN), where the math gives +inf, the infinite value times positive weights.
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", "100")
    q, k, v, grad = half_inputs(dtype)
    v[0, 1, 110, 5] = float("inf")
    (out, _, _), (ref_out, _, _) = run_and_oracle(q, k, v, None, need_weights, grad)
    assert ref_out[0, 1, :, 5].isposinf().all()
    assert torch.equal(out.isposinf(), ref_out.isposinf()) and not out.isnan().any()
    assert_close(out.nan_to_num(posinf=0.0), ref_out.nan_to_num(posinf=0.0), dtype)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_native_without_the_instructions_widens(monkeypatch, dtype):
    if native_products(dtype):
        pytest.skip(f"this CPU multiplies {dtype} natively")
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "native")
    assert "widened to float32: this CPU has no native" in products_note(dtype)
    q, k, v, _ = half_inputs(dtype)
    native = torch.ops.fastmha.attention(q, k, v, None, 0.0, True, False)
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "widen")
    assert "widened to float32 (FASTMHA_CPU_HALF_GEMM=widen)" in products_note(dtype)
    widened = torch.ops.fastmha.attention(q, k, v, None, 0.0, True, False)
    for a, b in zip(native, widened):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_auto_multiplies_natively_from_enough_rows_and_keys_a_row_computes(monkeypatch, dtype):
    # The default: native products where the CPU has them once a head has enough query rows and they multiply
    # enough keys (the keys a padding mask leaves), widened below (and on every other CPU). With the operands packed
    # by portable code and no AMX tiles: from 256 query rows and 256 keys. Where the products run on AMX tiles: from
    # 256 query rows, a forward without kept weights at any key count and a backward from 20 keys; the forward also
    # from 128 query rows in chunks of 128 or more: with these 4 heads on 2 threads 255 rows make chunks of 128, 193
    # rows 128 + 65 (the last computed as 80 rows), 128 rows chunks of 64 (see also test_kernel_choice.py); the
    # backward from 128 query rows. Without tiles on operands packed in AVX-512 (fastmha's AVX512 kernels): from 32
    # query rows, a forward without kept weights at any key count, a backward from 32 keys.
    native = native_products(dtype)
    tiles = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}[dtype] in cpu_flags()  # oneDNN's, as ATen packs
    packed_fast = not tiles and fastmha._C.cpu_capability() == "avx512"
    kind = "tiles" if tiles else "fast" if packed_fast else "portable"
    fewest_rows = 32 if packed_fast else 256
    fewest_keys = {"tiles": (0, 20), "fast": (0, 32), "portable": (256, 256)}[kind]  # forward, backward
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    # (query rows, keys, visible keys, {kind: forward and backward, n native, w widened}, why the widened widen)
    cases = ((256, 255, None, dict(tiles="nn", fast="nn", portable="ww"), "keys"),
             (256, 256, None, dict(tiles="nn", fast="nn", portable="nn"), ""),
             (255, 600, None, dict(tiles="nn", fast="nn", portable="ww"), "rows"),
             (193, 600, None, dict(tiles="nn", fast="nn", portable="ww"), "rows"),
             (128, 600, None, dict(tiles="wn", fast="nn", portable="ww"), "rows"),
             (127, 600, None, dict(tiles="ww", fast="nn", portable="ww"), "rows"),
             (64, 600, None, dict(tiles="ww", fast="nn", portable="ww"), "rows"),
             (63, 600, None, dict(tiles="ww", fast="nn", portable="ww"), "rows"),
             (32, 600, None, dict(tiles="ww", fast="nn", portable="ww"), "rows"),
             (31, 600, None, dict(tiles="ww", fast="ww", portable="ww"), "rows"),
             (256, 600, 100, dict(tiles="nn", fast="nn", portable="ww"), "keys"),
             (256, 600, 32, dict(tiles="nn", fast="nn", portable="ww"), "keys"),
             (256, 600, 31, dict(tiles="nn", fast="nw", portable="ww"), "keys"),
             (256, 600, 20, dict(tiles="nn", fast="nw", portable="ww"), "keys"),
             (256, 600, 19, dict(tiles="nw", fast="nw", portable="ww"), "keys"),
             (256, 600, 400, dict(tiles="nn", fast="nn", portable="nn"), ""))
    names = {"n": "native", "w": "widen"}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the chunks of the rows follow the thread count
    try:
        for lq, lk, visible, expected_by_kind, fewer in cases:
            forward, backward = (names[c] for c in expected_by_kind[kind]) if native else ("widen", "widen")
            q, k, v, grad = half_inputs(dtype, lq=lq, lk=lk)
            mask = None if visible is None else padding([visible, visible], lk=lk)
            monkeypatch.delenv("FASTMHA_CPU_HALF_GEMM", raising=False)
            notes = fastmha.explain(q, k, v, mask, 0.0, False).splitlines()
            for note, expected in zip(notes, (forward, backward)):
                assert ("own instructions" in note) is (expected == "native"), (lq, lk, visible, note)
                if not native:
                    assert "this CPU has no native" in note
                elif expected == "widen":
                    keys = fewest_keys[0] if note.startswith("forward") else fewest_keys[1]
                    why = {"keys": f"fewer than {keys} keys a row multiplies",
                           "rows": f"fewer than {fewest_rows} query rows"}
                    assert why[fewer] in note
            got = run_and_oracle(q, k, v, mask, False, grad)[0]
            monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", forward)
            forced = run_and_oracle(q, k, v, mask, False, grad)[0]
            assert torch.equal(got[0], forced[0]), (lq, lk, visible)
            if forward == backward:  # the backward reads the forward's output
                assert all(torch.equal(a, b) for a, b in zip(got[2], forced[2])), (lq, lk, visible)
    finally:
        torch.set_num_threads(threads)


def test_float_types_have_no_products_note(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "reference")
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "blas")  # its own note (test_float_products.py)
    assert products_note(torch.float32) == "forward fastmha-cpu: the weights are kept: only fastmha's kernel returns " \
                                           "them from a fused pass"


def test_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_KERNELS", "own")
    monkeypatch.setenv("FASTMHA_CPU_HALF_GEMM", "amx")
    message = re.escape("FASTMHA_CPU_HALF_GEMM must be auto, widen, native or reference, got 'amx'")
    for dtype in (torch.bfloat16, torch.float32):  # checked in every dtype, as FASTMHA_CPU_KERNELS is
        q = torch.randn(1, 1, 4, 8, dtype=dtype)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.fastmha.attention(q, q, q, None, 0.0, True, False)
        with pytest.raises(RuntimeError, match=message):
            fastmha.explain(q, q, q)


@pytest.mark.parametrize("block", ["64", "100", ""], ids=["block=64", "block=100", "block=auto"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_is_causal_mixes_blocks_with_and_without_the_cut(half_products, monkeypatch, block, dtype):
    # The blocks below a chunk's first row take the raw products and one pass per row; those the causal cut
    # crosses write -1e9 into scaled scores first: both kinds fold into the same running max and sum of a row.
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    q, k, v, grad = half_inputs(dtype, lq=300, lk=300)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.fastmha.attention(*inputs, None, 0.0, False, True)
    got = torch.autograd.grad(out, inputs, grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref, torch.ones(300, 300, dtype=torch.bool).tril(), None, 0.0)
    want = torch.autograd.grad(ref_out, ref, grad.double())
    assert_attention_close((out, None, got), (ref_out, ref_weights, want), dtype, False)


def late_keys_mask(lq, lk):
    """Padding that hides each sequence's first 40 keys as well: the first rows see no key below their causal limit
    (uniform over all keys), later ones a run that starts past some rows' limits; one row also shows the last key."""
    mask = padding([150, 30], lk=lk).expand(B, 1, lq, lk).clone()
    mask[..., :40] = False
    mask[0, 0, 70, lk - 1] = True
    return mask


@pytest.mark.parametrize("mask_kind", ["padding", "late keys"])
@pytest.mark.parametrize("block", ["16", "64", ""], ids=["block=16", "block=64", "block=auto"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_is_causal_with_a_mask_matches_the_oracle(half_products, monkeypatch, mask_kind, block, dtype):
    # is_causal and a mask together: blocks that both read the mask and take the causal cut, and rows whose
    # visible keys lie beyond the causal limit of some rows of their chunk.
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    lq = lk = 200
    q, k, v, grad = half_inputs(dtype, lq=lq, lk=lk)
    mask = padding([150, 30], lk=lk) if mask_kind == "padding" else late_keys_mask(lq, lk)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.fastmha.attention(*inputs, mask, 0.0, False, True)
    got = torch.autograd.grad(out, inputs, grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_weights = oracle_attention(*ref, mask & torch.ones(lq, lk, dtype=torch.bool).tril(), None, 0.0)
    want = torch.autograd.grad(ref_out, ref, grad.double())
    assert_attention_close((out, None, got), (ref_out, ref_weights, want), dtype, False)


@pytest.mark.parametrize("lengths", [[0, 150], [1, 64], [65, 129]], ids=["no key, all", "1, 64", "65, 129"])
@pytest.mark.parametrize("causal", [False, True], ids=["padding", "padding and causal"])
@pytest.mark.parametrize("block", ["16", "64", ""], ids=["block=16", "block=64", "block=auto"])
@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_padded_heads_pack_the_keys_up_to_the_last_visible_one(half_products, monkeypatch, lengths, causal, block,
                                                               dtype):
    # Each head packs its keys and values only up to the last key a row of its mask shows (all of them for a
    # sequence with a row that shows none, uniform over all keys), and blocks end there: with one mask row for all
    # queries, and with (B, 1, Lq, Lk) rows of padding and the causal triangle, whose rows reach different keys.
    monkeypatch.setenv("FASTMHA_CPU_KEY_BLOCK", block)
    q, k, v, grad = half_inputs(dtype)
    mask = padding(lengths)
    if causal:
        mask = mask & torch.ones(LQ, LK, dtype=torch.bool).tril()
    got, want = run_and_oracle(q, k, v, mask, False, grad)
    assert_attention_close(got, want, dtype, False)
