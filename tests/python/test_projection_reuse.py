"""Reused key/value projections: a decoder re-run over a growing prefix against one encoder output gets the same
numbers as recomputing every projection, and any change of the key, value or weights is seen."""

import contextlib
import copy
import gc
import io
import pickle
import subprocess
import sys
import weakref

import pytest
import torch
from conftest import OpCounter
from oracle import OracleBlock

import fastmha
from fastmha._projection_memo import ProjectionMemo


def ops_run(call):
    """(the fastmha ops that call() ran, its result)."""
    counter = OpCounter()
    with counter:
        result = call()
    return counter.names, result


class CrossAttention(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, memory):
        return self.block(x, memory, memory)


def blocks(d_model=32, h=4, dtype=torch.float64, device="cpu", **options):
    torch.manual_seed(0)
    reusing = fastmha.MultiHeadAttentionBlock(d_model, h, 0.0, **options).to(device, dtype).eval()
    fresh = fastmha.MultiHeadAttentionBlock(d_model, h, 0.0, reuse_projections=False, **options)
    fresh = fresh.to(device, dtype).eval()
    fresh.load_state_dict(reusing.state_dict())
    oracle = OracleBlock(d_model, h).to(device, dtype)
    oracle.load_state_dict(reusing.state_dict())
    return reusing, fresh, oracle


def padding_mask(batch, length, kept):
    return (torch.arange(length)[None, :] < torch.tensor(kept)[:, None])[:, None, None, :].to(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kept", [[7, 11], [3, 5]])  # the second leaves most keys unseen: they are not projected
def test_decoding_loop_matches_recomputation_bit_for_bit(device, dtype, need_weights, kept):
    reusing, fresh, oracle = blocks(dtype=dtype, device=device, need_weights=need_weights)
    memory = torch.randn(2, 11, 32, dtype=dtype, device=device)
    mask = padding_mask(2, 11, kept).to(device)
    with torch.no_grad():
        for length in range(1, 7):
            x = torch.randn(2, length, 32, dtype=dtype, device=device)
            counter = OpCounter()
            with counter:
                out = reusing(x, memory, memory, mask)
            # On the CPU the first call runs the block's forward and keeps the projections; later ones project
            # the query and run the attention core only. CUDA tensors are never kept (the bit comparison would
            # synchronize the device each call).
            reused = device == "cpu" and length > 1
            # With a mask, the kept projections may leave out unseen keys: the call checks they weigh nothing.
            assert counter.names == (["_projection", "_attention_forward", "_unseen_keys_weigh_zero", "_projection"]
                                     if reused else ["_multi_head_attention_forward"])
            expected = fresh(x, memory, memory, mask)
            assert torch.equal(out, expected)
            if need_weights:
                assert torch.equal(reusing.attention_scores, fresh.attention_scores)
            else:
                assert reusing.attention_scores is None
            if dtype == torch.float64:
                ref_out, ref_weights = oracle(x, memory, memory, mask)
                torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("is_causal", [False, True])
def test_distinct_key_and_value_and_causal(is_causal):
    reusing, fresh, oracle = blocks(is_causal=is_causal)
    key, value = torch.randn(3, 9, 32, dtype=torch.float64), torch.randn(3, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        for length in (4, 9, 12):
            x = torch.randn(3, length, 32, dtype=torch.float64)
            out = reusing(x, key, value)
            assert torch.equal(out, fresh(x, key, value))
            causal = torch.ones(length, 9).tril() if is_causal else None
            torch.testing.assert_close(out, oracle(x, key, value, causal)[0])


def test_dropout_in_training_mode_draws_the_same_masks():
    reusing, fresh, _ = blocks()
    reusing.dropout.p = fresh.dropout.p = 0.3
    reusing.train(), fresh.train()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    with torch.no_grad():
        for length in (2, 3):
            x = torch.randn(2, length, 32, dtype=torch.float64)
            torch.manual_seed(5)
            out = reusing(x, memory, memory)
            torch.manual_seed(5)
            assert torch.equal(out, fresh(x, memory, memory))


def changes():
    """Ways the key/value projections become stale, each applied to (block, memory) -> new memory."""

    def in_place_memory(block, memory):
        memory.add_(1.0)
        return memory

    def new_memory_same_values(block, memory):
        return memory.clone()

    def optimizer_like_step(block, memory):
        block.w_k.weight.add_(0.5)
        return memory

    def value_weight_step(block, memory):
        block.w_v.weight.mul_(2.0)
        return memory

    def load_state_dict(block, memory):
        state = {name: t + 0.25 for name, t in block.state_dict().items()}
        block.load_state_dict(state)
        return memory

    def new_parameter(block, memory):
        block.w_k.weight = torch.nn.Parameter(torch.randn_like(block.w_k.weight))
        return memory

    def resized_in_place(block, memory):
        memory.resize_(memory.shape[0], memory.shape[1] - 2, memory.shape[2])
        return memory

    def write_through_data(block, memory):  # leaves the version counter alone
        block.w_k.weight.data.mul_(0.5)
        memory.data.add_(1.0)
        return memory

    def write_through_numpy(block, memory):  # memory shared with NumPy: no version counter either
        memory.numpy()[0, 0, 0] += 1.0
        return memory

    return [in_place_memory, new_memory_same_values, optimizer_like_step, value_weight_step, load_state_dict,
            new_parameter, resized_in_place, write_through_data, write_through_numpy]


@pytest.mark.parametrize("change", changes(), ids=lambda f: f.__name__)
def test_any_change_of_key_value_or_weights_is_seen(change):
    reusing, _, oracle = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        reusing(x, memory, memory)
        memory = change(reusing, memory)
        out = reusing(x, memory, memory)
    oracle.load_state_dict(reusing.state_dict())
    torch.testing.assert_close(out, oracle(x, memory, memory)[0])


def test_gradients_on_recompute_and_flow():
    reusing, _, oracle = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        reusing(x, memory, memory)
    out = reusing(x, memory, memory)  # gradients on: the full op, with its autograd
    assert out.grad_fn is not None
    (grad,) = torch.autograd.grad(out.sum(), memory)
    ref_memory = memory.detach().requires_grad_()
    (ref_grad,) = torch.autograd.grad(oracle(x, ref_memory, ref_memory)[0].sum(), ref_memory)
    torch.testing.assert_close(grad, ref_grad)


def test_inference_mode_and_self_attention_compute_afresh():
    reusing, fresh, _ = blocks()
    with torch.inference_mode():
        memory = torch.randn(2, 8, 32, dtype=torch.float64)  # an inference tensor: no version counter to watch
        for length in (2, 3):
            x = torch.randn(2, length, 32, dtype=torch.float64)
            counter = OpCounter()
            with counter:
                out = reusing(x, memory, memory)
            assert "_attention_forward" not in counter.names
            assert torch.equal(out, fresh(x, memory, memory))
    with torch.no_grad():
        for length in (4, 4):
            x = torch.randn(2, length, 32, dtype=torch.float64)
            counter = OpCounter()
            with counter:
                reusing(x, x, x)  # self-attention: the key changes with the query, nothing to reuse
            assert "_attention_forward" not in counter.names


def test_bad_inputs_after_a_reuse_still_get_the_blocks_errors():
    reusing, _, _ = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    with torch.no_grad():
        reusing(torch.randn(2, 3, 32, dtype=torch.float64), memory, memory)
        with pytest.raises(RuntimeError, match=r"query must have d_model = 32 .*\[2, 3, 16\]"):
            reusing(torch.randn(2, 3, 16, dtype=torch.float64), memory, memory)
        with pytest.raises(RuntimeError, match=r"key must have the query.s dtype Float, got Double"):
            reusing(torch.randn(2, 3, 32), memory, memory)
        with pytest.raises(RuntimeError, match=r"mask of shape \[3, 1, 8\] does not broadcast"):
            reusing(torch.randn(2, 3, 32, dtype=torch.float64), memory, memory, torch.ones(3, 1, 8))
        out = reusing(torch.randn(2, 3, 32, dtype=torch.float64), memory, memory)
    assert out.shape == (2, 3, 32)


@contextlib.contextmanager
def other_thread_count():
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# Settings that may change the projections' bits: GEMM results may depend on the thread count, and oneDNN on or off
# changes bfloat16 products on some CPUs. A memo made under one must not serve a call under another.
@pytest.mark.parametrize("setting", ["thread count", "oneDNN switch"])
def test_settings_that_change_the_bits_are_part_of_the_key(setting):
    reusing, _, _ = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    changed = (other_thread_count() if setting == "thread count"
               else torch.backends.mkldnn.flags(enabled=not torch.backends.mkldnn.enabled))
    with torch.no_grad():
        reusing(x, memory, memory)
        with changed:
            assert ops_run(lambda: reusing(x, memory, memory))[0] == ["_multi_head_attention_forward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_contiguous_query_matches_recomputation_bit_for_bit(dtype):
    # A sequence-first query made batch-first by a transpose: the reused call projects it as the op does.
    reusing, fresh, oracle = blocks(dtype=dtype)
    memory = torch.randn(2, 8, 32, dtype=dtype)
    queries = torch.randn(5, 2, 32, dtype=dtype).transpose(0, 1)
    with torch.no_grad():
        first = reusing(queries, memory, memory)
        names, again = ops_run(lambda: reusing(queries, memory, memory))
        assert "_multi_head_attention_forward" not in names  # the memo served it
        assert torch.equal(first, again)
        assert torch.equal(again, fresh(queries, memory, memory))
        torch.testing.assert_close(again, oracle(queries, memory, memory)[0])


def test_per_backend_precision_settings_keep_the_memo_and_float16_working():
    # Once torch's per-backend fp32 precision settings are used, its legacy getter raises: the block reads the new
    # ones. In a fresh process, since the settings cannot be undone.
    script = """
import torch, fastmha
torch.backends.mkldnn.matmul.fp32_precision = "bf16"
block = fastmha.MultiHeadAttentionBlock(16, 2, 0.0).eval()
q, memory = torch.randn(2, 3, 16), torch.randn(2, 7, 16)
with torch.no_grad():
    first, again = block(q, memory, memory), block(q, memory, memory)
assert torch.equal(first, again)
out, _ = torch.ops.fastmha.multi_head_attention(torch.randn(2, 3, 16, dtype=torch.float16),
    *(torch.randn(2, 3, 16, dtype=torch.float16) for _ in range(2)),
    *(torch.randn(16, 16, dtype=torch.float16) for _ in range(4)), 2)
assert torch.isfinite(out).all()
# oneDNN's matmuls may round fp32 to bfloat16: float16 stays as it is. Only CUDA's may (legacy getter raises too):
# float16 is widened where the CPU has no native float16 products.
assert not fastmha._C.cpu_widens_products("float16", 64)
torch.backends.mkldnn.matmul.fp32_precision = "ieee"
torch.backends.cuda.matmul.fp32_precision = "tf32"
assert fastmha._C.cpu_widens_products("float16", 64) is not fastmha._C.cpu_native_products("float16")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_negated_views_as_key_value_and_mask():
    # A negated view (the imaginary part of a conjugate) has bits that torch does not reinterpret; the memo compares
    # the values it reads, and sees a change of its base.
    reusing, fresh, _ = blocks()
    base = torch.randn(2, 8, 32, dtype=torch.complex128)
    memory = base.conj().imag
    seen = (torch.arange(8) < 5).double().expand(2, 1, 1, 8)
    mask = torch.complex(torch.zeros_like(seen), seen).conj().imag  # -1 (nonzero) where visible
    assert memory.is_neg() and mask.is_neg()
    for step in range(3):
        x = torch.randn(2, 3 + step, 32, dtype=torch.float64)
        with torch.no_grad():
            ran, got = ops_run(lambda: reusing(x, memory, memory, mask))
            want = fresh(x, memory, memory, mask)
        assert torch.equal(got, want)
        # Kept at the first call, reused at the second; the base changed after it, so the third projects again.
        assert ran == (["_projection", "_attention_forward", "_unseen_keys_weigh_zero", "_projection"] if step == 1
                       else ["_multi_head_attention_forward"])
        if step == 1:
            base.imag.mul_(2)


def test_is_causal_is_part_of_the_key():
    # With a padding mask the block projects only the keys some query sees, but with is_causal all of them: a
    # memo made without is_causal must not serve a call with it.
    reusing, fresh, _ = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    mask = padding_mask(2, 8, [3, 8])
    with torch.no_grad():
        reusing(x, memory, memory, mask)
        reusing.is_causal = fresh.is_causal = True
        names, got = ops_run(lambda: reusing(x, memory, memory, mask))
        assert names == ["_multi_head_attention_forward"]
        assert torch.equal(got, fresh(x, memory, memory, mask))


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_tracing_and_vmap_take_the_op():
    reusing, _, oracle = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        reusing(x, memory, memory)
        # A trace must not record the kept projections as constants: the traced graph reads its key and value.
        traced = torch.jit.trace(CrossAttention(reusing), (x, memory))
        other = torch.randn(2, 8, 32, dtype=torch.float64)
        torch.testing.assert_close(traced(x, other), oracle(x, other, other)[0])
        xs, memories = torch.randn(3, 2, 4, 32, dtype=torch.float64), torch.randn(3, 2, 8, 32, dtype=torch.float64)
        batched = torch.vmap(lambda x, m: reusing(x, m, m))(xs, memories)
        for i in range(3):
            torch.testing.assert_close(batched[i], oracle(xs[i], memories[i], memories[i])[0])


def test_vmap_over_the_query_alone_keeps_no_batched_projections():
    # vmap over queries against one shared encoder output: the memo must not keep the transform's tensors, which
    # a later plain call would then meet.
    reusing, _, oracle = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    xs = torch.randn(3, 2, 4, 32, dtype=torch.float64)
    with torch.no_grad():
        batched = torch.vmap(lambda x: reusing(x, memory, memory))(xs)
        x = torch.randn(2, 4, 32, dtype=torch.float64)
        torch.testing.assert_close(reusing(x, memory, memory), oracle(x, memory, memory)[0])
    for i in range(3):
        torch.testing.assert_close(batched[i], oracle(xs[i], memory, memory)[0])


def test_projections_are_freed_with_the_key_and_value():
    memo = ProjectionMemo()
    key = torch.randn(4, 4)
    projections = (torch.randn(4, 4),)
    memo.store((key,), projections)
    assert memo.lookup((key,)) is projections
    assert memo.lookup((key.clone(),)) is None
    assert memo.lookup((key,), context="another stream") is None
    del key
    gc.collect()
    assert memo._entry is None
    assert pickle.loads(pickle.dumps(memo, protocol=0)).lookup((torch.ones(1),)) is None


def test_projections_are_freed_with_the_block():
    reusing, _, _ = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    with torch.no_grad():
        reusing(torch.randn(2, 3, 32, dtype=torch.float64), memory, memory)
    kept = weakref.ref(reusing._projection_memo._entry.projections[0])
    gc.disable()  # no reference cycle may keep them: plain reference counting frees them
    try:
        del reusing
        assert kept() is None
    finally:
        gc.enable()


def test_copies_and_pickles_carry_no_memo():
    reusing, _, oracle = blocks()
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        reusing(x, memory, memory)
        buffer = io.BytesIO()
        torch.save(reusing, buffer)
        buffer.seek(0)
        for copied in (copy.deepcopy(reusing), pickle.loads(pickle.dumps(reusing)),
                       torch.load(buffer, weights_only=False)):
            assert copied._projection_memo.lookup((memory,)) is None
            torch.testing.assert_close(copied(x, memory, memory), oracle(x, memory, memory)[0])
    assert "reuse_projections=True" in repr(reusing)


def test_blocks_pickled_without_the_memo_still_run():
    reusing, _, oracle = blocks()
    del reusing.__dict__["_projection_memo"], reusing.__dict__["reuse_projections"]  # as an older version pickled
    restored = pickle.loads(pickle.dumps(reusing))
    memory = torch.randn(2, 8, 32, dtype=torch.float64)
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(restored(x, memory, memory), oracle(x, memory, memory)[0])
    assert restored.reuse_projections


def test_memo_keeps_an_expanded_mask_at_its_own_size_and_compares_its_values():
    memo = ProjectionMemo()
    memory = torch.randn(4, 9, 8)
    projections = (torch.randn(4, 9, 8),)
    padding = torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7, [1] * 9])[:, None, None, :]
    expanded = padding.expand(4, 1, 6, 9)  # one row per query, as a decoder step would pass it
    memo.store([memory], projections, mask=expanded)
    assert memo._entry.mask.values.numel() == padding.numel()  # not 4 * 6 * 9
    # Equal values hit, whatever their memory layout; other values, shapes or dtypes miss.
    assert memo.lookup([memory], mask=expanded) is projections
    assert memo.lookup([memory], mask=expanded.contiguous()) is projections
    assert memo.lookup([memory], mask=padding.clone().expand(4, 1, 6, 9)) is projections
    changed = expanded.clone()
    changed[1, 0, 3, 6] = 1
    assert memo.lookup([memory], mask=changed) is None
    assert memo.lookup([memory], mask=padding) is None
    assert memo.lookup([memory], mask=expanded.bool()) is None
    assert memo.lookup([memory]) is None
