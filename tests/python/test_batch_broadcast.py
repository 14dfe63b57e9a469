"""An input of batch 1 broadcasts against the others' batch, as the textbook block's matmuls broadcast it (learned
queries over a batch of memories, one memory for a batch of queries): outputs, kept weights and gradients against
the oracle block, on the fused path, the module path and a scripted block."""

import pytest
import torch

import fastmha
from oracle import OracleBlock

D_MODEL, H, BATCH = 16, 2, 3

# Which of query, key and value have batch 1.
SHAPES = {"query": (1, BATCH, BATCH), "memory": (BATCH, 1, 1), "value": (BATCH, BATCH, 1),
          "query and key": (1, 1, BATCH)}


def blocks():
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, H, 0.0).double()
    oracle = OracleBlock(D_MODEL, H).double()
    oracle.load_state_dict(block.state_dict())
    return block, oracle


def make_inputs(batches):
    torch.manual_seed(1)
    q = torch.randn(batches[0], 4, D_MODEL, dtype=torch.float64)
    k = torch.randn(batches[1], 6, D_MODEL, dtype=torch.float64)
    v = torch.randn(batches[2], 6, D_MODEL, dtype=torch.float64)
    mask = torch.ones(BATCH, 1, 1, 6, dtype=torch.int64)
    mask[1, ..., 4:] = 0  # padded keys in one batch entry
    return q, k, v, mask


def forward_and_grads(module, q, k, v, mask, params):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module(*inputs, mask)
    ours = isinstance(module, (fastmha.MultiHeadAttentionBlock, torch.jit.ScriptModule))
    weights = module.attention_scores if ours else out[1]
    out = out if ours else out[0]
    (out.sin().sum() + weights.square().sum()).backward()
    return out, weights, [t.grad for t in inputs] + [p.grad for p in params]


@pytest.mark.parametrize("hooked", [False, True], ids=["fused", "module path"])
@pytest.mark.parametrize("case", SHAPES)
def test_batch_one_broadcasts_as_the_oracle(case, hooked):
    block, oracle = blocks()
    if hooked:
        block.w_k.register_forward_hook(lambda module, args, output: None)
    q, k, v, mask = make_inputs(SHAPES[case])
    out, weights, grads = forward_and_grads(block, q, k, v, mask, [block.w_q.weight, block.w_o.weight])
    want, want_weights, want_grads = forward_and_grads(oracle, q, k, v, mask, [oracle.w_q.weight, oracle.w_o.weight])
    assert out.shape == (BATCH, 4, D_MODEL) and weights.shape == (BATCH, H, 4, 6)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_weights)
    for got, expected in zip(grads, want_grads):
        assert got.shape == expected.shape  # a batch-1 input's gradient keeps its batch of 1
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("mask_shape", [None, (1, 1, 1, 6), (4, 6)])
@pytest.mark.parametrize("path", ["plain", "hooked", "scripted"])
def test_query_and_key_of_batch_one_keep_weights_of_batch_one(path, mask_shape):
    # With the query, key and mask of batch 1 the textbook's weights have batch 1, and the values' batch broadcasts
    # them.
    block, oracle = blocks()
    if path == "hooked":
        block.w_k.register_forward_hook(lambda module, args, output: None)
    q, k, v, _ = make_inputs(SHAPES["query and key"])
    mask = None if mask_shape is None else (torch.arange(6) < 5).expand(mask_shape)
    model = torch.jit.script(block) if path == "scripted" else block
    out, weights, grads = forward_and_grads(model, q, k, v, mask, [block.w_q.weight, block.w_v.weight])
    want, want_weights, want_grads = forward_and_grads(oracle, q, k, v, mask, [oracle.w_q.weight, oracle.w_v.weight])
    assert out.shape == (BATCH, 4, D_MODEL) and weights.shape == (1, H, 4, 6)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_weights)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("repeated", [False, True], ids=["batch 1", "expanded"])
def test_weights_of_batch_one_share_their_dropout_over_the_values(repeated, scripted):
    # The textbook drops the weights of batch 1 once, then multiplies every value entry by the same dropped weights.
    # A value repeated along its batch is projected once and still gives every entry's output.
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, H, 0.4).double().train()
    oracle = OracleBlock(D_MODEL, H).double()
    oracle.load_state_dict(block.state_dict())
    model = torch.jit.script(block) if scripted else block
    q, k, v, _ = make_inputs(SHAPES["query and key"])
    if repeated:
        v = v[:1].expand(BATCH, -1, -1)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = model(*inputs)
    weights = model.attention_scores
    assert weights.shape == (1, H, 4, 6) and (weights == 0).any()
    out.sin().sum().backward()
    oracle_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = oracle(*oracle_inputs, None, keep=weights != 0, p=0.4)  # softmax weights are positive where kept
    want.sin().sum().backward()
    torch.testing.assert_close(out, want)
    for got, expected in zip(inputs + [block.w_q.weight], oracle_inputs + [oracle.w_q.weight]):
        torch.testing.assert_close(got.grad, expected.grad)


@pytest.mark.parametrize("widened", ["w_q", "w_v"])
@pytest.mark.parametrize("case", ["query and key", "all"])
def test_a_projection_that_widens_the_batch_broadcasts_as_the_oracle(case, widened):
    # A hook may return a projection of a wider batch than its input: the textbook's matmuls broadcast it too, and
    # the weights take the batch of the projected query and key.
    block, oracle = blocks()
    noise = torch.randn(BATCH, 1, D_MODEL, dtype=torch.float64)
    for module in (block, oracle):
        getattr(module, widened).register_forward_hook(lambda m, args, output: output.expand(BATCH, -1, -1) + noise)
    q, k, v, _ = make_inputs(SHAPES["query and key"] if case == "query and key" else (1, 1, 1))
    out, want = block(q, k, v), oracle(q, k, v)
    assert out.shape == want[0].shape == (BATCH, 4, D_MODEL)
    assert block.attention_scores.shape == want[1].shape
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(block.attention_scores, want[1])


@pytest.mark.parametrize("batches", ["query and key", "memory"])
@pytest.mark.parametrize("case", ["nested", "list"])
def test_a_bad_mask_is_named_on_the_module_path(case, batches):
    # Whether the weights have batch 1 is asked of the mask only after the query's and key's batch (both 1).
    block, _ = blocks()
    block.w_q.register_forward_hook(lambda module, args, output: None)
    q, k, v, _ = make_inputs(SHAPES[batches])
    if case == "nested":
        mask = torch.nested.nested_tensor([torch.ones(1, 1, 6)] * BATCH)
        message = "mask must be a dense \\(strided\\) tensor, got a nested tensor"
    else:
        mask = [[1, 1, 0, 1, 1, 1]]
        message = "for argument 'mask' but instead found type 'list'"
    with pytest.raises(RuntimeError, match=message):
        block(q, k, v, mask)


def test_batch_one_without_kept_weights_and_in_no_grad():
    block, oracle = blocks()
    block.need_weights = False
    q, k, v, mask = make_inputs(SHAPES["query"])
    want, _ = oracle(q, k, v, mask)
    torch.testing.assert_close(block(q, k, v, mask), want)
    with torch.no_grad():  # twice: the second call may reuse the memory's projections
        torch.testing.assert_close(block(q, k, v, mask), want)
        torch.testing.assert_close(block(q, k, v, mask), want)


def test_scripted_block_broadcasts_batch_one():
    block, oracle = blocks()
    scripted = torch.jit.script(block)
    q, k, v, mask = make_inputs(SHAPES["memory"])
    torch.testing.assert_close(scripted(q, k, v, mask), oracle(q, k, v, mask)[0])


def test_other_batch_mismatches_are_still_named():
    block, _ = blocks()
    q, k, v, mask = make_inputs((2, BATCH, BATCH))
    with pytest.raises(RuntimeError, match=r"same batch size \(dim 0\), got query \[2, 4, 16\], key \[3, 6, 16\]"):
        block(q, k, v, mask)


def test_batch_one_is_projected_once():
    # The textbook block projects the batch-1 input as given and broadcasts in the attention products: a hook on
    # the projection sees the caller's batch of 1, and the projection runs once, not once per batch entry.
    block, oracle = blocks()
    seen = []
    block.w_q.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    q, k, v, mask = make_inputs(SHAPES["query"])
    torch.testing.assert_close(block(q, k, v, mask), oracle(q, k, v, mask)[0])
    assert seen == [(1, 4, D_MODEL)]


def test_batch_one_memory_without_gradients_takes_the_module_path():
    # No projection memo for a broadcast memory: the block projects it once per call, with the modules.
    block, oracle = blocks()
    q, k, v, mask = make_inputs(SHAPES["memory"])
    with torch.no_grad():
        for _ in range(2):
            with torch.profiler.profile() as prof:
                out = block(q, k, v, mask)
            names = {event.name for event in prof.events()}
            assert "fastmha::attention" in names and "fastmha::multi_head_attention" not in names
            torch.testing.assert_close(out, oracle(q, k, v, mask)[0])


def test_batch_mismatches_name_the_callers_shapes():
    block, _ = blocks()
    q, k, v, mask = make_inputs((1, BATCH, 2))
    for hooked in (False, True):  # the op's check, and the module path's
        if hooked:
            block.w_q.register_forward_hook(lambda module, args, output: None)
        with pytest.raises(RuntimeError, match=r"same batch size \(dim 0\)(, or 1)?, got query \[1, 4, 16\], "
                                               r"key \[3, 6, 16\], value \[2, 6, 16\]"):
            block(q, k, v, mask)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_inputs_are_named():
    block, _ = blocks()
    nested = torch.nested.nested_tensor([torch.randn(4, D_MODEL), torch.randn(6, D_MODEL)], dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"query must be a dense \(strided\) tensor"):
        block(nested, nested, nested)
    block.w_k = torch.nn.Linear(D_MODEL, D_MODEL, bias=True).double()  # the module path, scripted
    with pytest.raises(Exception, match=r"query must be a dense \(strided\) tensor"):  # torch.jit.Error
        torch.jit.script(block)(nested, nested, nested)


class ProjectionRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the rows of every matrix product torch runs (a projection's is its input's batch * length)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.rows.append(args[-2].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["memory", "query", "all"])
def test_an_expanded_input_is_projected_once(case):
    # One entry repeated along the batch without copies (expand: stride 0), as a memory shared by a batch of
    # queries is often passed: projected once, as an input of batch 1 is, with the same results as the oracle's.
    block, oracle = blocks()
    q, k, v, mask = make_inputs({"memory": (BATCH, 1, 1), "query": (1, BATCH, BATCH), "all": (1, 1, 1)}[case])
    q, k, v = [x.expand(BATCH, -1, -1) for x in (q, k, v)]
    originals = [x.clone() for x in (q, k, v)]
    with torch.no_grad():
        want, want_weights = oracle(q, k, v, mask)
        block.w_q.register_forward_pre_hook(lambda module, args: None)  # hooks see what the caller passed
        shapes = []
        block.w_v.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
        torch.testing.assert_close(block(q, k, v, mask), want)
        assert shapes == [(BATCH, 6, D_MODEL)]
        block, _ = blocks()
        with ProjectionRows() as recorder:
            out = block(q, k, v, mask)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(block.attention_scores, want_weights)
    assert block.attention_scores.shape == (BATCH, H, 4, 6)
    repeated = [x.stride(0) == 0 for x in (q, k, v)]
    assert sorted(recorder.rows[:3]) == sorted([(1 if r else BATCH) * x.shape[1] for r, x in zip(repeated, (q, k, v))])
    for before, after in zip(originals, (q, k, v)):
        assert torch.equal(before, after)


def test_an_expanded_input_that_asks_a_gradient_keeps_its_own():
    # A gradient asked of the expanded tensor itself is per entry: the block projects every entry.
    block, oracle = blocks()
    q, k, v, mask = make_inputs((BATCH, 1, 1))
    grads = []
    for module in (block, oracle):
        memory = k.clone().requires_grad_()
        expanded = memory.expand(BATCH, -1, -1)
        expanded.retain_grad()
        out = module(q, expanded, expanded, mask)
        (out if isinstance(out, torch.Tensor) else out[0]).sin().sum().backward()
        grads.append((memory.grad, expanded.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


@pytest.mark.filterwarnings("ignore:The tensor attribute self.attention_scores was assigned during export")
@pytest.mark.parametrize("recorder", ["export", "trace"])
def test_a_graph_recorded_on_an_expanded_input_serves_any_input(recorder):
    # A recorded graph keeps no check of its inputs' strides: one recorded on an expanded memory must not project
    # its first entry only for a memory of distinct entries.
    block, _ = blocks()
    q, k, _, mask = make_inputs((BATCH, 1, 1))
    expanded, memory = k.expand(BATCH, -1, -1), torch.randn(BATCH, 6, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        if recorder == "export":
            recorded = torch.export.export(block, (q, expanded, expanded, mask)).module()
        else:
            recorded = torch.jit.trace(block, (q, expanded, expanded, mask))
        torch.testing.assert_close(recorded(q, memory, memory, mask), block(q, memory, memory, mask))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_sparse_compressed_inputs_are_named():
    block, _ = blocks()
    x = torch.randn(BATCH, 4, D_MODEL, dtype=torch.float64)
    for sparse in (x.to_sparse_csr(), x.to_sparse_coo()):
        with pytest.raises(RuntimeError, match=r"key must be a dense \(strided\) tensor"):
            block(x, sparse, sparse)


def test_a_scripted_block_projects_an_expanded_input_once():
    block, oracle = blocks()
    scripted = torch.jit.script(block)
    q, k, v, mask = make_inputs((BATCH, 1, 1))
    k, v = k.expand(BATCH, -1, -1), v.expand(BATCH, -1, -1)
    with torch.no_grad(), ProjectionRows() as recorder:
        out = scripted(q, k, v, mask)
    torch.testing.assert_close(out, oracle(q, k, v, mask)[0])
    assert sorted(recorder.rows[:3]) == [6, 6, BATCH * 4]
    memory = torch.randn(BATCH, 6, D_MODEL, dtype=torch.float64)  # distinct entries: each projected
    with torch.no_grad():
        torch.testing.assert_close(scripted(q, memory, memory, mask), oracle(q, memory, memory, mask)[0])
