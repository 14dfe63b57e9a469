"""The block calls its four projection modules, as the textbook block does, when they are not plain bias-free
nn.Linear modules: a hook on them (forward, backward or global), a parametrized or biased Linear, or another module
in their place. Checked against the oracle block given the same modules and hooks; plain projections still take
the block's op."""

from typing import Tuple

import pytest
import torch
from conftest import OpCounter
from oracle import OracleBlock, oracle_attention
from torch import Tensor, nn
from torch.nn.utils import parametrizations

import fastmha


class LowRankAdapted(nn.Module):
    """A wrapper in a Linear's place, as adapter libraries install them: base(x) + x A^T B^T."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def pair(d_model=16, h=2):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(d_model, h, 0.0).double()
    oracle = OracleBlock(d_model, h).double()
    oracle.load_state_dict(block.state_dict())
    return block, oracle


def inputs(d_model=16):
    x = torch.randn(2, 5, d_model, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.int64)
    mask[1, ..., 3:] = 0
    return x, mask


def check_against_oracle(block, oracle, params):
    """Output, weights and gradients (of the input and of `params`: pairs of block and oracle tensors)."""
    x, mask = inputs()
    out = block(x, x, x, mask)
    xo = x.detach().clone().requires_grad_()
    want, want_weights = oracle(xo, xo, xo, mask)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(block.attention_scores, want_weights)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [x] + [p for p, _ in params], grad_out)
    expected = torch.autograd.grad(want, [xo] + [p for _, p in params], grad_out)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_plain_projections_take_the_blocks_op():
    block, _ = pair()
    x, mask = inputs()
    names = OpCounter()
    with names:
        block(x, x, x, mask)
    assert "_multi_head_attention_forward" in names.names


def test_hooked_projections_run_the_attention_core_alone():
    block, _ = pair()
    block.w_o.register_forward_hook(lambda module, args, output: None)
    x, mask = inputs()
    names = OpCounter()
    with names:
        block(x, x, x, mask)
    assert "_multi_head_attention_forward" not in names.names and "_attention_forward" in names.names


def test_forward_hooks_run_and_may_replace_the_output():
    block, oracle = pair()
    seen = []
    for model in (block, oracle):
        model.w_q.register_forward_hook(lambda module, args, output: seen.append(output.shape))
        model.w_v.register_forward_hook(lambda module, args, output: output * 2)
    check_against_oracle(block, oracle, [(block.w_v.weight, oracle.w_v.weight)])
    assert seen == [torch.Size([2, 5, 16])] * 2  # once in the block, once in the oracle


@pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated")
def test_forward_pre_hook_weight_norm_is_applied():
    # The older weight_norm recomputes the weight in a forward pre-hook: reading .weight without calling the
    # module would use a stale one.
    block, oracle = pair()
    for model in (block, oracle):
        nn.utils.weight_norm(model.w_k)
        with torch.no_grad():
            model.w_k.weight_g.mul_(3.0)
    check_against_oracle(block, oracle, [(block.w_k.weight_g, oracle.w_k.weight_g)])


def test_parametrized_biased_and_wrapped_projections():
    block, oracle = pair()
    torch.manual_seed(1)
    biased = nn.Linear(16, 16, bias=True).double()
    for model in (block, oracle):
        parametrizations.weight_norm(model.w_q)
        model.w_o = biased
    block.w_k = LowRankAdapted(block.w_k).double()
    oracle.w_k = LowRankAdapted(oracle.w_k).double()
    oracle.w_k.load_state_dict(block.w_k.state_dict())
    check_against_oracle(block, oracle, [(block.w_k.up.weight, oracle.w_k.up.weight), (biased.bias, biased.bias)])


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_global_module_hooks_see_the_projections(kind):
    block, _ = pair()
    called = []
    register = getattr(nn.modules.module, f"register_module_{kind}_hook")
    handle = register(lambda module, *args: called.append(type(module).__name__))
    try:
        x, mask = inputs()
        block(x, x, x, mask)
    finally:
        handle.remove()
    assert called.count("Linear") == 4


BAD_INPUTS = {
    "d_model": (lambda x, y: (x[..., :6], y, y), "query must have d_model = 16 features"),
    "2-D query": (lambda x, y: (x[0], y, y), "query must be 3-D"),
    "4-D query": (lambda x, y: (x.unsqueeze(2), y, y), "query must be 3-D"),
    "batch": (lambda x, y: (x, torch.cat([y, y[:1]]), torch.cat([y, y[:1]])), "the same batch size"),
    "batches 1, 3 and 2": (lambda x, y: (x[:1], torch.cat([y, y[:1]]), y), "the same batch size"),
    "None query": (lambda x, y: (None, y, y), "query must be a tensor, got None"),
    "None value": (lambda x, y: (x, y, None), "value must be a tensor, got None"),
    "integer query": (lambda x, y: (x.long(), y, y), "query must be a floating-point tensor"),
    "dtype": (lambda x, y: (x.float(), y, y), "key must have the query's dtype"),
    "length": (lambda x, y: (x, y, y[:, :2]), "key and value must have the same length"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_hooked_block_checks_its_inputs_as_the_op_does(case):
    make, message = BAD_INPUTS[case]
    x, y = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    for hooked in (False, True):
        block, _ = pair()
        if hooked:
            block.w_q.register_forward_hook(lambda module, args, output: None)
        with pytest.raises(RuntimeError, match=message):
            block(*make(x, y))


@pytest.mark.parametrize("p", [float("nan"), 1.5, -0.1])
def test_dropout_set_after_construction_is_checked(p):
    block = fastmha.MultiHeadAttentionBlock(16, 2, 0.1).train()
    block.dropout.p = p
    x = torch.randn(2, 5, 16)
    message = "dropout probability has to be between 0 and 1"
    with pytest.raises(ValueError, match=message):
        block(x, x, x)
    with pytest.raises(ValueError, match=message):
        block.forward_step(x)
    with pytest.raises(ValueError, match=message):
        fastmha.MultiHeadAttentionBlock.attention(*(torch.randn(2, 2, 5, 8) for _ in range(3)), None, block.dropout)


def test_dropout_one_keeps_the_output_projections_bias():
    # nn.Dropout(1.0) drops every weight before w_o: the textbook block then returns w_o(0) = w_o's bias.
    block, oracle = pair()
    biased = nn.Linear(16, 16, bias=True).double()
    block.w_o = oracle.w_o = biased
    block.dropout.p = 1.0
    block.train()
    x, mask = inputs()
    out = block(x, x, x, mask)
    torch.testing.assert_close(out, biased.bias.expand_as(out))
    assert torch.count_nonzero(block.attention_scores) == 0
    out.sum().backward()
    torch.testing.assert_close(biased.bias.grad, torch.full_like(biased.bias, out.shape[0] * out.shape[1]))


@pytest.mark.parametrize("kind", ["biased w_v", "hooked w_q", "adapted w_k"])
def test_forward_step_calls_the_projection_modules_as_forward_does(kind):
    # Stepping through a sequence gives forward's outputs with a causal mask, also for modules forward calls.
    block, _ = pair()
    if kind == "biased w_v":
        block.w_v = nn.Linear(16, 16, bias=True).double()
    elif kind == "hooked w_q":
        block.w_q.register_forward_hook(lambda module, args, output: output * 1.5)
    else:
        block.w_k = LowRankAdapted(block.w_k).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    pad = torch.ones(2, 1, 1, 6, dtype=torch.int64)
    causal = torch.ones(6, 6, dtype=torch.int64).tril()
    with torch.no_grad():
        whole = block(x, x, x, causal * pad)
        outputs, cache = [], None
        for t in range(6):
            out, cache = block.forward_step(x[:, t:t + 1], cache, pad[..., :t + 1])
            outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, 1), whole)


def test_scripted_block_keeps_a_projections_bias():
    # TorchScript runs no hooks, but a bias it can see: the scripted block calls the modules then, as eager does.
    block, _ = pair()
    block.w_o = nn.Linear(16, 16, bias=True).double()
    block.eval()
    scripted = torch.jit.script(block)
    x, mask = inputs()
    with torch.no_grad():
        torch.testing.assert_close(scripted(x, x, x, mask), block(x, x, x, mask))
        step, _ = scripted.forward_step(x[:, :1])
        torch.testing.assert_close(step, block.forward_step(x[:, :1])[0])


class Scaled(nn.Module):
    """A projection without a weight of its own: a Linear and a scale, as a wrapper (LoRA, say) has it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * 0.5


def test_scripted_block_with_a_projection_without_a_weight():
    # The scripted code leaves out the fused path, which reads every projection's weight, and calls the modules.
    block, oracle = pair()
    block.w_k, block.w_o = Scaled(block.w_k), nn.Sequential(block.w_o, nn.Tanh())
    scripted = torch.jit.script(block.eval())
    x, mask = inputs()
    with torch.no_grad():
        out = scripted(x, x, x, mask)
        q, k, v = (oracle.split(w(x)) for w in (oracle.w_q, lambda t: oracle.w_k(t) * 0.5, oracle.w_v))
        heads, _ = oracle_attention(q, k, v, mask, None, 0.0)
        torch.testing.assert_close(out, torch.tanh(oracle.w_o(heads.transpose(1, 2).reshape(x.shape))))
        torch.testing.assert_close(out, block(x, x, x, mask))
        torch.testing.assert_close(scripted.forward_step(x[:, :2])[0], block.forward_step(x[:, :2])[0])


class BlockWithConstants(fastmha.MultiHeadAttentionBlock):
    """A subclass with constants of its own (TorchScript reads only the subclass's __constants__)."""

    __constants__ = ["scale"]

    def __init__(self, *args):
        super().__init__(*args)
        self.scale = 1.0


def test_scripted_subclass_with_its_own_constants_and_a_projection_without_a_weight(tmp_path):
    torch.manual_seed(0)
    block = BlockWithConstants(16, 2, 0.0).double().eval()
    block.w_q = nn.Sequential(block.w_q)
    scripted = torch.jit.script(block)
    torch.jit.save(scripted, str(tmp_path / "block.pt"))
    loaded = torch.jit.load(str(tmp_path / "block.pt"))
    x, mask = inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, x, x, mask), block(x, x, x, mask))


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated", "ignore:torch.quantize_per_tensor")
def test_a_dynamically_quantized_block_scripts():
    # quantize_dynamic puts quantized Linear layers (whose weight is a method) in the projections' place: eager and
    # scripted blocks call them, as the textbook block would.
    if not hasattr(torch.ao.quantization, "quantize_dynamic"):
        pytest.skip("this torch has no eager-mode dynamic quantization")
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(16, 2, 0.0).eval()
    quantized = torch.ao.quantization.quantize_dynamic(block, {nn.Linear}, dtype=torch.qint8)
    scripted = torch.jit.script(quantized)
    x, mask = torch.randn(2, 5, 16), torch.tensor([1, 1, 1, 0, 0])
    q, k, v = (w(x).view(2, 5, 2, 8).transpose(1, 2) for w in (quantized.w_q, quantized.w_k, quantized.w_v))
    heads, _ = oracle_attention(q, k, v, mask, None, 0.0)
    want = quantized.w_o(heads.transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(scripted(x, x, x, mask), want)
    torch.testing.assert_close(quantized(x, x, x, mask), want)
    torch.testing.assert_close(scripted.forward_step(x[:, :1])[0], quantized.forward_step(x[:, :1])[0])


@pytest.mark.parametrize("hooked", [False, True])
def test_scripted_block_names_a_none_input(hooked):
    # TorchScript would pass None to a Tensor argument as an undefined tensor, whose dtype prints as a number.
    block, _ = pair()
    if hooked:
        block.w_q.register_forward_hook(double_output)
    scripted = torch.jit.script(block)
    x, _ = inputs()
    for args, name in (((None, x, x), "query"), ((x, None, x), "key"), ((x, x, None), "value")):
        with pytest.raises(Exception, match=name + " must be a tensor, got None$"):
            scripted(*args)
    with pytest.raises(Exception, match="x must be a tensor, got None$"):
        scripted.forward_step(None)


STEP_BAD = {
    "integer cache": (dict(cache=(torch.ones(2, 2, 4, 8, dtype=torch.long),) * 2), "key_cache must have the projected keys' dtype Double"),
    "cache shape": (dict(cache=(torch.randn(2, 2, 4, 7, dtype=torch.float64),) * 2), r"must have shape \(batch, heads, T_past, d_k\)"),
    "complex mask": (dict(mask=torch.ones(7, dtype=torch.complex64)), "mask must be a real or bool tensor, got ComplexFloat"),
    "mask length": (dict(mask=torch.ones(2, 1, 1, 5)), r"mask of shape \[2, 1, 1, 5\] does not broadcast to the scores \(batch, h, Lq, Lk\) \[2, 2, 3, 7\]"),
    "meta mask": (dict(mask=torch.ones(7, device="meta")), "mask must be on the x's device cpu, got meta"),
    "x features": (dict(x=torch.randn(2, 3, 15, dtype=torch.float64)), r"x must have d_model = 16 features \(last dim\)"),
    "integer x": (dict(x=torch.ones(2, 3, 16, dtype=torch.long)), "x must be a floating-point tensor"),
}


@pytest.mark.parametrize("case", STEP_BAD)
def test_hooked_forward_step_checks_its_caches_and_mask_as_the_op_does(case):
    changes, message = STEP_BAD[case]
    x = changes.get("x", torch.randn(2, 3, 16, dtype=torch.float64))
    cache = changes.get("cache", (torch.randn(2, 2, 4, 8, dtype=torch.float64),) * 2)
    for hooked in (False, True):
        block, _ = pair()
        if hooked:
            block.w_k.register_forward_hook(lambda module, args, output: None)
        with pytest.raises(RuntimeError, match=message):
            block.forward_step(x, cache, changes.get("mask"))


def double_output(module: nn.Module, args: Tuple[Tensor], output: Tensor) -> Tensor:
    return output * 2.0


def test_scripted_block_runs_the_hooks_it_was_scripted_with():
    # TorchScript runs scriptable hooks: a block hooked when scripted calls its modules in the scripted code too.
    block, _ = pair()
    block.w_q.register_forward_hook(double_output)
    block.eval()
    scripted = torch.jit.script(block)
    x, mask = inputs()
    with torch.no_grad():
        torch.testing.assert_close(scripted(x, x, x, mask), block(x, x, x, mask))
        with pytest.raises(Exception, match="query must be 3-D"):  # torch.jit.Error carries the message
            scripted(x[0], x, x, mask)


@pytest.mark.filterwarnings("ignore:The tensor attribute self.attention_scores was assigned during export")
def test_exported_block_keeps_a_projection_hook():
    # torch.export records the hooked projection as the eager block runs it (torch.jit.trace cannot trace such a
    # block: see api.md); the oracle block with the same hook is the reference.
    block, oracle = pair()
    for module in (block, oracle):
        module.w_q.register_forward_hook(double_output)
        module.eval()
    x, mask = inputs()
    x = x.detach()
    exported = torch.export.export(block, (x, x, x, mask)).module()
    with torch.no_grad():
        torch.testing.assert_close(exported(x, x, x, mask), oracle(x, x, x, mask)[0])


def test_static_attention_checks_the_dropout_probability_in_eval_too():
    dropout = nn.Dropout(0.1).eval()
    dropout.p = 1.5
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
        fastmha.MultiHeadAttentionBlock.attention(*(torch.randn(2, 2, 5, 8) for _ in range(3)), None, dropout)
