"""TorchScript: the block scripts (alone and inside a model), saves, and loads back with the same numbers."""

from typing import Optional

import torch
from oracle import OracleBlock
from torch import Tensor, nn

import fastmha


class EncoderLayer(nn.Module):
    """A small Transformer layer around the block, as users script it."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.attention = fastmha.MultiHeadAttentionBlock(d_model, heads, 0.1)
        self.norm = nn.LayerNorm(d_model)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.ReLU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        x = self.norm(x + self.attention(x, x, x, mask))
        return x + self.feed_forward(x)


def test_script_block_matches_eager_and_oracle():
    block = fastmha.MultiHeadAttentionBlock(16, 4, 0.0).double().eval()
    scripted = torch.jit.script(block)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.tril(torch.ones(5, 5))
    out = scripted(x, x, x, mask)
    oracle = OracleBlock(16, 4).double()
    oracle.load_state_dict(block.state_dict())
    ref_out, ref_weights = oracle(x, x, x, mask)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(scripted.attention_scores, ref_weights)


def test_scripted_block_keeps_python_semantics():
    block = torch.jit.script(fastmha.MultiHeadAttentionBlock(8, 2, 0.5, need_weights=False))
    x = torch.randn(1, 3, 8)
    block.eval()
    assert torch.equal(block(x, x, x, None), block(x, x, x, None))  # eval: no dropout
    assert block.attention_scores is None
    assert [name for name, _ in block.named_parameters()] == ["w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"]


def test_script_save_load_model_round_trip(tmp_path):
    model = EncoderLayer(16, 4).eval()
    scripted = torch.jit.script(model)
    path = tmp_path / "layer.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path))
    x = torch.randn(3, 6, 16)
    mask = (torch.rand(3, 1, 1, 6) > 0.2)
    expected = model(x, mask)
    torch.testing.assert_close(loaded(x, mask), expected, rtol=0, atol=0)
    torch.testing.assert_close(scripted(x, mask), expected, rtol=0, atol=0)


def test_scripted_model_trains():
    model = torch.jit.script(EncoderLayer(16, 4).train())
    x = torch.randn(2, 4, 16)
    model(x, None).pow(2).mean().backward()
    grads = [p.grad for p in model.attention.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_ops_callable_from_torchscript_functions():
    @torch.jit.script
    def core(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]):
        return torch.ops.fastmha.attention(q, k, v, mask, 0.0, True)

    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    out, weights = core(q, k, v, None)
    expected_out, expected_weights = torch.ops.fastmha.attention(q, k, v)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(weights, expected_weights)
