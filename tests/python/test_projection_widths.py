"""Projections replaced by Linear layers of other widths, which the textbook block takes: keys and values from a
wider encoder (w_k, w_v: Linear(24, d_model)), queries of another width, an output projection to another width.
The block calls its modules then, against the oracle block holding the same modules."""

import copy

import pytest
import torch
from torch import nn

import fastmha
from oracle import OracleBlock

D_MODEL, H = 16, 2


def blocks(widths):
    """fastmha's block and the oracle with w_q, w_k, w_v taking widths[0..2] features and w_o giving widths[3]."""
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, H, 0.0).double()
    oracle = OracleBlock(D_MODEL, H).double()
    for name, width in zip(("w_q", "w_k", "w_v"), widths[:3]):
        setattr(block, name, nn.Linear(width, D_MODEL, bias=False).double())
    block.w_o = nn.Linear(D_MODEL, widths[3], bias=False).double()
    for name in ("w_q", "w_k", "w_v", "w_o"):
        setattr(oracle, name, nn.Linear(getattr(block, name).in_features, getattr(block, name).out_features,
                                        bias=False).double())
    oracle.load_state_dict(block.state_dict())
    return block, oracle


WIDTHS = {"wider memory": (16, 24, 24, 16), "narrow queries": (12, 16, 16, 16), "wider output": (16, 16, 16, 20),
          "all": (12, 24, 20, 8)}


def inputs(widths):
    torch.manual_seed(1)
    q = torch.randn(2, 5, widths[0], dtype=torch.float64)
    k = torch.randn(2, 7, widths[1], dtype=torch.float64)
    v = torch.randn(2, 7, widths[2], dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.int64)
    mask[1, ..., 5:] = 0
    return q, k, v, mask


@pytest.mark.parametrize("case", WIDTHS)
def test_other_widths_match_the_oracle(case):
    block, oracle = blocks(WIDTHS[case])
    q, k, v, mask = inputs(WIDTHS[case])
    grads = []
    for module in (block, oracle):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*ins, mask)
        weights = block.attention_scores if module is block else out[1]
        out = out if module is block else out[0]
        (out.sin().sum() + weights.square().sum()).backward()
        grads.append((out, weights, [t.grad for t in ins] + [module.w_k.weight.grad, module.w_o.weight.grad]))
    (out, weights, got), (want, want_weights, expected) = grads
    assert out.shape == (2, 5, WIDTHS[case][3])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_weights)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_scripted_block_with_other_widths():
    block, oracle = blocks(WIDTHS["all"])
    q, k, v, mask = inputs(WIDTHS["all"])
    scripted = torch.jit.script(block)
    torch.testing.assert_close(scripted(q, k, v, mask), oracle(q, k, v, mask)[0])
    # torch.jit.Error carries the message
    with pytest.raises(Exception, match=r"key must have 24 features \(last dim\), the input width of w_k, got shape"):
        scripted(q, v, v, mask)


def test_inputs_of_the_wrong_width_are_named():
    block, _ = blocks(WIDTHS["all"])
    q, k, v, mask = inputs(WIDTHS["all"])
    with pytest.raises(RuntimeError, match=r"query must have 12 features \(last dim\), the input width of w_q, got "
                                           r"shape \[2, 7, 24\]"):
        block(k, k, v, mask)
    with pytest.raises(RuntimeError, match=r"value must have 20 features \(last dim\), the input width of w_v"):
        block(q, k, k, mask)
    square, _ = blocks(WIDTHS["wider memory"])
    with pytest.raises(RuntimeError, match=r"query must have d_model = 16 features \(last dim\), got shape \[2, 7, 24\]"):
        square(k, k, k, mask)


def ops_run(block, widths):
    q, k, v, mask = inputs(widths)
    with torch.profiler.profile() as prof:
        block(q, k, v, mask)
    return {event.name for event in prof.events()}


def test_square_replacements_keep_the_fused_op():
    # A new bias-free Linear(d_model, d_model) is as plain as the block's own: the fused op still reads it. Other
    # widths take the module path: the modules' products around the attention core op.
    names = ops_run(blocks((16, 16, 16, 16))[0], (16, 16, 16, 16))
    assert "fastmha::multi_head_attention" in names and "fastmha::attention" not in names
    names = ops_run(blocks(WIDTHS["wider memory"])[0], WIDTHS["wider memory"])
    assert "fastmha::multi_head_attention" not in names and "fastmha::attention" in names


def test_projections_to_other_widths_are_named():
    # The textbook block views each projection as h heads of d_k, and w_o takes the merged heads: other widths
    # fail there. fastmha names the module.
    block, _ = blocks((16, 16, 16, 16))
    q, k, v, mask = inputs((16, 16, 16, 16))
    block.w_q = block.w_k = nn.Linear(16, 32, bias=False).double()
    with pytest.raises(RuntimeError, match=r"w_q\(query\) must give d_model = 16 features \(last dim\) to split into "
                                           r"heads, got shape \[2, 5, 32\]"):
        block(q, k, v, mask)
    block, _ = blocks((16, 16, 16, 16))
    block.w_v = nn.Linear(16, 15, bias=False).double()
    with pytest.raises(RuntimeError, match=r"w_v\(value\) must give d_model = 16 features"):
        block(q, k, v, mask)
    with pytest.raises(RuntimeError, match=r"w_v\(x\) must give d_model = 16 features"):
        block.forward_step(q)
    block, _ = blocks((16, 16, 16, 16))
    block.w_o = nn.Linear(20, 16, bias=False).double()
    with pytest.raises(RuntimeError, match=r"w_o must take the merged heads' d_model = 16 features, got a Linear layer "
                                           r"of input width 20"):
        block(q, k, v, mask)


def test_lazy_projections_take_their_width_from_the_first_input():
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, H, 0.0).double()
    block.w_k, block.w_v = nn.LazyLinear(D_MODEL, bias=False).double(), nn.LazyLinear(D_MODEL, bias=False).double()
    q, k, v, mask = inputs(WIDTHS["wider memory"])
    out = block(q, k, v, mask)
    oracle = OracleBlock(D_MODEL, H).double()
    oracle.w_k, oracle.w_v = nn.Linear(24, D_MODEL, bias=False).double(), nn.Linear(24, D_MODEL, bias=False).double()
    oracle.load_state_dict(block.state_dict())  # the lazy layers' weights, made by the first call
    torch.testing.assert_close(out, oracle(q, k, v, mask)[0])
    with pytest.raises(RuntimeError, match=r"key must have 24 features"):  # now a Linear(24, d_model)
        block(q, q, v, mask)


def test_a_replaced_weight_sets_the_width():
    # The product uses the weight: a (d_model, 24) weight set on a Linear(16, 16) takes 24 features, as in the
    # textbook block, whatever in_features still says.
    block, oracle = blocks((16, 16, 16, 16))
    block.w_k.weight = nn.Parameter(torch.randn(D_MODEL, 24, dtype=torch.float64))
    oracle.w_k = nn.Linear(24, D_MODEL, bias=False).double()
    oracle.load_state_dict(block.state_dict())
    q, k, v, mask = inputs((16, 24, 16, 16))
    torch.testing.assert_close(block(q, k, v, mask), oracle(q, k, v, mask)[0])


def test_decoding_steps_with_other_input_widths():
    # Self-attention over 24-feature inputs: w_q, w_k and w_v take 24 features. Stepping gives forward's causal
    # outputs.
    block, _ = blocks((24, 24, 24, 16))
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    block.is_causal = True
    full = block(x, x, x)
    cache, steps = None, []
    for t in range(6):
        out, cache = block.forward_step(x[:, t:t + 1], cache)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), full)
    with pytest.raises(RuntimeError, match=r"x must have 24 features \(last dim\), the input width of w_q"):
        block.forward_step(torch.randn(2, 1, 16, dtype=torch.float64))


def test_a_wrapper_of_another_width_is_taken():
    # A module that is not a Linear layer says nothing of its input width: its output is checked instead.
    block, oracle = blocks(WIDTHS["wider memory"])
    block.w_k = nn.Sequential(block.w_k)
    q, k, v, mask = inputs(WIDTHS["wider memory"])
    torch.testing.assert_close(block(q, k, v, mask), oracle(q, k, v, mask)[0])


def test_a_weight_gathered_by_a_hook_is_not_read_before_the_call():
    # Sharded training (ZeRO stage 3) leaves each weight empty between calls and gathers it in a forward pre-hook:
    # its width is unknown until the module runs, so only the module's output is checked.
    block, oracle = blocks((16, 16, 16, 16))
    for linear in (block.w_q, block.w_k, block.w_v, block.w_o):
        full = linear.weight.data
        linear.weight.data = torch.empty(0, dtype=full.dtype)
        linear.register_forward_pre_hook(lambda module, args, full=full: setattr(module.weight, "data", full))
        linear.register_forward_hook(
            lambda module, args, output: setattr(module.weight, "data", torch.empty(0, dtype=output.dtype)))
    q, k, v, mask = inputs((16, 16, 16, 16))
    torch.testing.assert_close(block(q, k, v, mask), oracle(q, k, v, mask)[0])
    assert block.w_q.weight.numel() == 0  # gathered and released again


def test_a_step_checks_x_against_each_projection():
    block, _ = blocks((24, 16, 16, 16))  # only w_q takes 24 features: no x fits all three
    with pytest.raises(RuntimeError, match=r"x must have d_model = 16 features \(last dim\), got shape \[2, 1, 24\]"):
        block.forward_step(torch.randn(2, 1, 24, dtype=torch.float64))


@pytest.mark.parametrize("case", ["biased", "wider memory", "batch 1"])
def test_module_paths_compile_to_one_graph(case):
    # torch.compile(fullgraph=True) through the module path: the path's checks and width reads must not break
    # the graph.
    widths = WIDTHS["wider memory"] if case == "wider memory" else (16, 16, 16, 16)
    block, oracle = blocks(widths)
    q, k, v, mask = inputs(widths)
    if case == "biased":
        block.w_k = nn.Linear(D_MODEL, D_MODEL, bias=True).double()
        oracle.w_k = nn.Linear(D_MODEL, D_MODEL, bias=True).double()
        oracle.load_state_dict(block.state_dict())
    if case == "batch 1":
        q = q[:1]
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, mask), oracle(q, k, v, mask)[0])


def test_a_lazy_projection_compiles():
    # A lazy layer's weight is not read before its first input: a compiled block with one runs as eager does.
    torch.manual_seed(0)
    eager = fastmha.MultiHeadAttentionBlock(D_MODEL, H, 0.0).double()
    eager.w_k, eager.w_v = nn.LazyLinear(D_MODEL, bias=False).double(), nn.LazyLinear(D_MODEL, bias=False).double()
    compiled_block = copy.deepcopy(eager)
    q, k, v, mask = inputs(WIDTHS["wider memory"])
    torch.manual_seed(1)  # the lazy layers initialise their weights from the same random state
    # Static shapes: on torch 2.11 a lazy layer cannot initialise under the dynamic sizes that earlier compiles of
    # the block's forward (other tests) would give it.
    got = torch.compile(compiled_block, backend="eager", dynamic=False)(q, k, v, mask)
    torch.manual_seed(1)
    torch.testing.assert_close(got, eager(q, k, v, mask))
    torch.testing.assert_close(compiled_block.w_k.weight, eager.w_k.weight)
