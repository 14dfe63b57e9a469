"""torch.compile (fullgraph, dynamic shapes, forward and backward) and torch.export round trips."""

import pytest
import torch
from torch import nn

import fastmha


class Layer(nn.Module):
    def __init__(self, need_weights=False, is_causal=False):
        super().__init__()
        self.attention = fastmha.MultiHeadAttentionBlock(32, 4, 0.0, need_weights=need_weights, is_causal=is_causal)
        self.norm = nn.LayerNorm(32)

    def forward(self, x, mask):
        return self.norm(x + self.attention(x, x, x, mask))


def assert_compiled_matches_eager(compiled, eager, lengths):
    """Output and input gradient of (batch 2, L, 32) inputs with padding masks, at each length; new lengths reuse
    the dynamic graph."""
    for length in lengths:
        x = torch.randn(2, length, 32, requires_grad=True)
        mask = torch.rand(2, 1, 1, length) > 0.2
        out = compiled(x, mask)
        (grad_compiled,) = torch.autograd.grad(out.square().sum(), x)
        ref = eager(x, mask)
        (grad_eager,) = torch.autograd.grad(ref.square().sum(), x)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(grad_compiled, grad_eager)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])  # CUDA graphs in the latter apply on GPUs
def test_compile_fullgraph_dynamic_matches_eager_forward_and_backward(mode):
    torch.manual_seed(0)
    model = Layer(need_weights=True, is_causal=True)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, mode=mode)  # a graph break would raise
    assert_compiled_matches_eager(compiled, model, lengths=(7, 12, 17))


def test_export_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Layer().eval()
    x, mask = torch.randn(2, 7, 32), torch.rand(2, 1, 1, 7) > 0.2
    exported = torch.export.export(model, (x, mask))
    # The block's fused op, not its projections around the core op (the weights are traced as fake tensors).
    assert torch.ops.fastmha.multi_head_attention.default in [node.target for node in exported.graph.nodes]
    torch.export.save(exported, tmp_path / "layer.pt2")
    loaded = torch.export.load(tmp_path / "layer.pt2")
    torch.testing.assert_close(loaded.module()(x, mask), model(x, mask))


def test_compile_core_op_on_split_heads_dynamic():
    # The textbook's own head split around the core op: its output comes in the query's (batch, L, h, d)
    # memory, and the compiled graph (which checks the fake kernels' strides) agrees with eager.
    torch.manual_seed(0)
    weights = [torch.randn(32, 32) / 32**0.5 for _ in range(3)]

    def attend(x, mask):
        b, length, _ = x.shape
        heads = [(x @ w).view(b, length, 4, 8).transpose(1, 2) for w in weights]
        out = fastmha.MultiHeadAttentionBlock.attention(*heads, mask, None)[0]
        assert out.stride(2) == 32  # (batch, L, h, d) memory, in the graph as in eager
        return out.transpose(1, 2).contiguous().view(b, length, 32)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    assert_compiled_matches_eager(compiled, attend, lengths=(5, 9, 13))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_compiled_autograd_training_step_matches_eager(need_weights, dropout):
    # Compiled autograd traces the backward graph through each op's autograd node, so the nodes must be traceable
    # with and without kept weights (the weight-less call has one differentiable output).
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(32, 4, dropout, need_weights=need_weights)
    x, mask = torch.randn(2, 9, 32), torch.rand(2, 1, 1, 9) > 0.3
    heads = [torch.randn(2, 4, 9, 8, requires_grad=True) for _ in range(3)]

    def step():
        torch.manual_seed(5)  # the same dropout mask in both runs
        out = block(x, x, x, mask)
        core, _ = torch.ops.fastmha.attention(*heads, mask, dropout, need_weights, False)
        loss = out.square().sum() + core.square().sum()
        return torch.autograd.grad(loss, [*block.parameters(), *heads])

    expected = step()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        got = torch.compile(step, backend="eager")()
    torch.testing.assert_close(got, expected)
