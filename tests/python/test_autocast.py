"""Autocast: the ops run in the autocast dtype (registered at the Autocast keys), accumulating in fp32."""

import pytest
import torch
from oracle import OracleBlock, oracle_attention

import fastmha


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_under_cpu_autocast(dtype):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(32, 4, 0.0)
    oracle = OracleBlock(32, 4)
    oracle.load_state_dict(block.state_dict())
    oracle.double()
    x = torch.randn(2, 9, 32, requires_grad=True)
    mask = torch.rand(2, 1, 1, 9) > 0.2
    with torch.autocast("cpu", dtype=dtype):
        out = block(x, x, x, mask)
    assert out.dtype == dtype and block.attention_scores.dtype == dtype
    ref_out, ref_weights = oracle(x.double(), x.double(), x.double(), mask)
    torch.testing.assert_close(out.double(), ref_out, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(block.attention_scores.double(), ref_weights, atol=2e-2, rtol=2e-2)
    out.float().sum().backward()  # gradients flow back to the fp32 input and weights
    assert x.grad.dtype == torch.float32 and block.w_q.weight.grad.dtype == torch.float32


def test_core_op_under_cpu_autocast():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = torch.ops.fastmha.attention(q, k, v)
    assert out.dtype == torch.bfloat16
    ref_out, _ = oracle_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), ref_out, atol=5e-2, rtol=5e-2)


def test_decoding_steps_under_cpu_autocast():
    # The step's caches come back in the autocast dtype and are accepted by the next step.
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(32, 4, 0.0).eval()
    x = torch.randn(2, 5, 32)
    causal = torch.ones(5, 5).tril()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = block(x, x, x, causal)
        outputs, cache = [], None
        for t in range(5):
            out, cache = block.forward_step(x[:, t:t + 1], cache)
            outputs.append(out)
    assert cache[0].dtype == torch.bfloat16 and outputs[0].dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(outputs, 1).float(), whole.float(), atol=5e-2, rtol=5e-2)
