"""The block's float32 projections on oneDNN (FASTMHA_CPU_FLOAT_GEMM, csrc/ops/cpu/onednn_linear.h and
brgemm_matmul.h): the forward's x W^T and the backward's g W and g^T x run there from 512 rows on where the switch
puts float32 products on oneDNN, and the block gives the oracle's output and gradients on either GEMM, with shared
or separate inputs, with padded rows (keys no query sees are projected apart, and the backward skips rows of zero
gradient) and at sizes that leave partial tiles."""

import os

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import OpCounter, assert_close
from oracle import OracleBlock
from test_float_products import amd_with_avx512, brgemm_runs_here
from torch.profiler import ProfilerActivity, profile

import fastmha

D_MODEL, HEADS = 32, 4
ONEDNN_OP = "mkldnn::_linear_pointwise"


def onednn_calls(fn):
    """fn's result and how many of torch's oneDNN linear calls it made."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(1 for event in prof.events() if event.name.startswith(ONEDNN_OP))


def block_and_oracle():
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.0)
    oracle = OracleBlock(D_MODEL, HEADS).double()
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    return block, oracle


def run(block, inputs, mask, loss_weights, dtype=torch.float32):
    """Output and gradients of the inputs (a tensor given twice is one leaf) and of the four weights, in dtype. The
    loss is (out * loss_weights).sum(), or out.sum() without loss weights (whose gradient reaches the block expanded
    from one element, stride 0)."""
    leaves = {id(t): t.detach().to(dtype).requires_grad_(True) for t in inputs}
    out = block(*(leaves[id(t)] for t in inputs), mask)
    out = out[0] if isinstance(out, tuple) else out
    (out.sum() if loss_weights is None else (out * loss_weights.to(dtype)).sum()).backward()
    grads = [leaf.grad for leaf in leaves.values()]
    return [out] + grads + [getattr(block, n).weight.grad for n in ("w_q", "w_k", "w_v", "w_o")]


def case(batch, length, sharing, padded):
    torch.manual_seed(length + len(sharing))
    x, memory = torch.randn(batch, length, D_MODEL), torch.randn(batch, length, D_MODEL)
    inputs = {"self": (x, x, x), "cross": (x, memory, memory), "separate": (x, memory, memory * 2)}[sharing]
    mask, loss_weights = None, torch.randn(batch, length, D_MODEL)
    if padded:  # the loss reads the kept positions only: the padded rows (35%) get zero gradients, skipped
        kept = torch.arange(length)[None, :] < torch.tensor([length * 2 // 3, length * 5 // 8])[:batch, None]
        mask, loss_weights = kept[:, None, None, :].to(torch.int64), loss_weights * kept[..., None]
    return inputs, mask, loss_weights


@pytest.mark.parametrize("mode", ["blas", "brgemm"])
@pytest.mark.parametrize("sharing", ["self", "cross", "separate"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_block_gives_the_oracle_on_either_gemm(monkeypatch, mode, sharing, padded):
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", mode)
    inputs, mask, loss_weights = case(2, 512, sharing, padded)
    kept_inputs = [t.clone() for t in inputs]
    block, oracle = block_and_oracle()
    got, calls = onednn_calls(lambda: run(block, inputs, mask, loss_weights))
    want = run(oracle, inputs, mask, loss_weights, torch.float64)
    assert len(got) == len(want)
    names = ["output"] + [f"grad of input {i}" for i in range(len(got) - 5)] + ["grad of w_q", "grad of w_k",
                                                                                 "grad of w_v", "grad of w_o"]
    for name, g, w in zip(names, got, want):
        assert_close(g, w, torch.float32, name)
    assert all(torch.equal(t, kept) for t, kept in zip(inputs, kept_inputs))
    # The forward's four projections; with padding, the keys and values that some query sees are projected apart,
    # a row count that changes from batch to batch, so on the BLAS (a new oneDNN kernel per count would cost more).
    assert calls == ((2 if padded else 4) if mode == "brgemm" and brgemm_runs_here() else 0), calls


def partial_tiles_case(mode, sharing, features=200):
    """543 gradient rows of 200 features (heads of 25): on brgemm the backward's products end in rows, columns and
    depth left over from whole tiles, and its transposed packing in partial 16 x 16 blocks (520 features: g W's
    depth of 520 in a step of 512 and one of 8). The block, its inputs (a tensor given twice is one input) and the
    loss's weights."""
    os.environ["FASTMHA_CPU_FLOAT_GEMM"] = mode
    torch.manual_seed(7)
    block = fastmha.MultiHeadAttentionBlock(features, 8, 0.0)
    x, memory = torch.randn(3, 181, features), torch.randn(3, 181, features)
    return block, (x, x, x) if sharing == "self" else (x, memory, memory * 2), torch.randn(3, 181, features)


@pytest.mark.parametrize("mode", ["blas", "brgemm"])
@pytest.mark.parametrize("sharing,features", [("self", 200), ("separate", 200), ("separate", 520)])
@pytest.mark.parametrize("loss", ["weighted", "sum"])
def test_backward_products_at_partial_tiles_give_the_oracle(monkeypatch, mode, sharing, features, loss):
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", mode)
    block, inputs, loss_weights = partial_tiles_case(mode, sharing, features)
    loss_weights = None if loss == "sum" else loss_weights
    oracle = OracleBlock(features, 8).double()
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    got = run(block, inputs, None, loss_weights)
    want = run(oracle, inputs, None, loss_weights, torch.float64)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if loss == "sum":
            # Every output row gets the same gradient, so the weight gradients are sums over 543 rows that cancel to
            # a small part of their terms (float32 rounding on either GEMM exceeds the element-wise tolerance
            # there): the tolerance is taken relative to the largest element.
            torch.testing.assert_close(g.double(), w, atol=2e-5 * w.abs().max().item(), rtol=2e-4,
                                       msg=lambda m: f"result {i}: {m}")
        else:
            assert_close(g, w, torch.float32, f"result {i}")


LARGEST_BACKWARD_BLAS_PRODUCT = """
import sys
sys.path.insert(0, sys.argv[2])
import torch
from test_onednn_projections import partial_tiles_case, run
from torch.profiler import ProfilerActivity, profile
block, inputs, loss_weights = partial_tiles_case(sys.argv[1], "separate")
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    run(block, inputs, None, None if sys.argv[3] == "sum" else loss_weights)
operands = {"aten::mm": slice(0, 2), "aten::addmm": slice(1, 3), "aten::addmm_": slice(1, 3)}
sizes = [e.input_shapes[operands[e.name]] for e in prof.events() if e.name in operands]
print(max(a[0] * a[1] * b[1] for a, b in sizes))
"""


@pytest.mark.parametrize("mode", ["blas", "brgemm"])
@pytest.mark.parametrize("loss", ["weighted", "sum"])
def test_backward_products_run_on_brgemm_in_whole_tiles(mode, loss):
    """On brgemm torch's GEMM multiplies only what whole tiles leave over (31 of 543 rows, here 1/17 of a
    product); on the BLAS whole products. Also where the output's gradient comes expanded (out.sum()), which is made
    dense for brgemm. In a fresh process: brgemm's places for new shapes are the process's."""
    import subprocess
    import sys
    from pathlib import Path
    result = subprocess.run([sys.executable, "-c", LARGEST_BACKWARD_BLAS_PRODUCT, mode, str(Path(__file__).parent),
                             loss],
                            capture_output=True, text=True, check=True, env={**os.environ,
                                                                            "PYTHONPATH": os.pathsep.join(sys.path)})
    whole = 543 * 200 * 200
    largest = int(result.stdout.split()[-1])
    if mode == "brgemm" and brgemm_runs_here():
        assert largest <= whole * 31 // 543, largest
    else:
        assert largest == whole, largest


def test_auto_puts_projections_on_onednn_on_amd_processors_with_avx512_only(monkeypatch):
    monkeypatch.delenv("FASTMHA_CPU_FLOAT_GEMM", raising=False)
    inputs, mask, loss_weights = case(2, 512, "self", False)
    _, calls = onednn_calls(lambda: run(block_and_oracle()[0], inputs, mask, loss_weights))
    assert (calls > 0) == (amd_with_avx512() and brgemm_runs_here()), calls


@pytest.mark.parametrize("why", ["511 rows", "float64", "oneDNN off"])
def test_projections_stay_on_the_blas(monkeypatch, why):
    """Below 512 rows (a new oneDNN kernel per length would cost more than it saves), in other dtypes, and with
    torch's oneDNN turned off."""
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "brgemm")
    inputs, mask, loss_weights = case(1, 511 if why == "511 rows" else 512, "self", False)
    block, oracle = block_and_oracle()
    if why == "float64":
        block = block.double()
    dtype = torch.float64 if why == "float64" else torch.float32
    with torch.backends.mkldnn.flags(enabled=why != "oneDNN off"):
        got, calls = onednn_calls(lambda: run(block, inputs, mask, loss_weights, dtype))
    assert calls == 0
    want = run(oracle, inputs, mask, loss_weights, torch.float64)
    assert_close(got[0], want[0], got[0].dtype, "output")


def test_compiled_block_matches_eager_on_onednn(monkeypatch):
    """Under torch.compile the graph is traced with fake tensors, which stay on torch's linear; the compiled
    call then runs on oneDNN and gives eager's numbers."""
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "brgemm")
    torch._dynamo.reset()
    inputs, mask, loss_weights = case(2, 512, "self", True)
    block = block_and_oracle()[0]
    eager = run(block, inputs, mask, loss_weights)
    block.zero_grad()
    compiled, calls = onednn_calls(
        lambda: run(torch.compile(block, backend="aot_eager", fullgraph=False), inputs, mask, loss_weights))
    for i, (g, w) in enumerate(zip(compiled, eager)):
        assert_close(g, w, torch.float32, f"result {i}")
    assert (calls > 0) == brgemm_runs_here(), calls


def step_output(x, block):
    """The decoding step over x without a cache (causal self-attention over its rows): a composite op, whose
    products autograd records."""
    weights = [getattr(block, n).weight for n in ("w_q", "w_k", "w_v", "w_o")]
    return torch.ops.fastmha.multi_head_attention_step(x, *weights, HEADS, None, None, None, 0.0)[0]


def causal(x):
    return torch.ones(x.size(1), x.size(1), dtype=torch.bool).tril()


@pytest.mark.parametrize("mode", ["blas", "brgemm"])
def test_decoding_step_of_many_rows_keeps_its_gradients(monkeypatch, mode):
    """torch's oneDNN linear has no derivative: where autograd records the step's products they stay torch's
    linear, and under no_grad they run on oneDNN."""
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", mode)
    (x, _, _), _, loss_weights = case(2, 300, "self", False)
    block, oracle = block_and_oracle()
    leaf = x.clone().requires_grad_(True)
    out = step_output(leaf, block)
    (out * loss_weights).sum().backward()
    got = [out, leaf.grad] + [getattr(block, n).weight.grad for n in ("w_q", "w_k", "w_v", "w_o")]
    want = run(oracle, (x, x, x), causal(x), loss_weights, torch.float64)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None, f"result {i} has no gradient"
        assert_close(g, w, torch.float32, f"result {i}")
    with torch.no_grad():
        no_grad_out, calls = onednn_calls(lambda: step_output(x, block))
    assert_close(no_grad_out, want[0], torch.float32, "output under no_grad")
    assert (calls > 0) == (mode == "brgemm" and brgemm_runs_here()), calls


def test_decoding_step_of_many_rows_keeps_its_forward_mode_tangent(monkeypatch):
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "brgemm")
    (x, _, _), _, _ = case(2, 300, "self", False)
    tangent = torch.randn_like(x)
    block, oracle = block_and_oracle()
    with torch.no_grad(), fwAD.dual_level():  # dual tensors are plain tensors carrying a tangent
        got = fwAD.unpack_dual(step_output(fwAD.make_dual(x, tangent), block)).tangent
    with torch.no_grad():
        _, want = torch.func.jvp(lambda t: oracle(t, t, t, causal(x))[0], (x.double(),), (tangent.double(),))
    assert got is not None
    assert_close(got, want, torch.float32, "tangent")


def test_decoding_step_of_many_rows_under_autocast_keeps_the_cast(monkeypatch):
    """torch's oneDNN op has no autocast rule: under CPU autocast the step's products stay torch's linear, which
    autocast casts, so its cache has the autocast dtype and the next step takes it."""
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "brgemm")
    block = block_and_oracle()[0].eval()
    torch.manual_seed(5)
    prefix, token = torch.randn(1, 512, D_MODEL), torch.randn(1, 1, D_MODEL)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, cache = block.forward_step(prefix)
        assert out.dtype == cache[0].dtype == cache[1].dtype == torch.bfloat16
        out, cache = block.forward_step(token, cache)
    assert out.dtype == torch.bfloat16 and cache[0].shape[-2] == 513


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["blas", "brgemm"])
def test_reused_projections_match_a_fresh_block_bit_for_bit(monkeypatch, dtype, mode):
    """The block's reuse of kept key and value projections computes the query and output projections as its op
    does (on oneDNN from 512 rows where the switch says so, after widening a half type where the CPU does), so a
    reusing block gives a fresh one's bits; a switch change between calls projects again."""
    monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", mode)
    torch.manual_seed(6)
    d_model = 256  # at 32 or 64 features both GEMMs happen to give the same bits
    reusing = fastmha.MultiHeadAttentionBlock(d_model, HEADS, 0.0).eval().to(dtype)
    fresh = fastmha.MultiHeadAttentionBlock(d_model, HEADS, 0.0, reuse_projections=False).eval().to(dtype)
    fresh.load_state_dict(reusing.state_dict())
    memory = torch.randn(1, 600, d_model, dtype=dtype)
    with torch.no_grad():
        for step, length in enumerate((600, 600, 700, 700)):
            if step == 3:  # kept under one GEMM, asked for under the other
                monkeypatch.setenv("FASTMHA_CPU_FLOAT_GEMM", "blas" if mode == "brgemm" else "brgemm")
            x = torch.randn(1, length, d_model, dtype=dtype)
            counter = OpCounter()
            with counter:
                got, calls = onednn_calls(lambda: reusing(x, memory, memory))
            want = fresh(x, memory, memory)
            assert torch.equal(got, want), (step, (got - want).abs().max())
            projected = step in (0, 3)  # the first call, and the first after the switch changed
            assert ("_multi_head_attention_forward" in counter.names) == projected, (step, counter.names)
            widened_or_float = dtype == torch.float32 or fastmha._C.cpu_widens_products("float16", length)
            on_onednn = os.environ["FASTMHA_CPU_FLOAT_GEMM"] == "brgemm" and brgemm_runs_here() and widened_or_float
            assert (calls > 0) == on_onednn, (step, calls)
