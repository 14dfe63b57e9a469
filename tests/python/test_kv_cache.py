"""Incremental decoding with a key/value cache equals full recomputation with a causal mask."""

import pytest
import torch

import fastmha


def full_causal(block, x, mask=None):
    length = x.size(1)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    return block(x, x, x, causal if mask is None else (mask != 0) & causal)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_steps_match_full_recomputation(chunk):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(24, 4, 0.0).double().eval()
    x = torch.randn(2, 13, 24, dtype=torch.float64)
    expected = full_causal(block, x)
    cache, outputs = None, []
    for start in range(0, 13, chunk):
        out, cache = block.forward_step(x[:, start:start + chunk], cache)
        outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, 1), expected)
    keys, values = cache
    assert keys.shape == values.shape == (2, 4, 13, 6)


def test_steps_with_a_padding_mask_and_gradients():
    torch.manual_seed(1)
    block = fastmha.MultiHeadAttentionBlock(16, 2, 0.0).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    # (A row masked everywhere, e.g. key 0 hidden from query 0, would be uniform over all 6 keys in the full
    # computation, future ones included; a step cannot see the future, so such rows differ by design.)
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)[:, None, None, :]
    expected = full_causal(block, x, pad)
    out_a, cache = block.forward_step(x[:, :4], None, pad[..., :4])
    out_b, _ = block.forward_step(x[:, 4:], cache, pad)
    out = torch.cat([out_a, out_b], 1)
    torch.testing.assert_close(out, expected)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (ref,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(grad, ref)


def test_forward_step_scripts():
    block = torch.jit.script(fastmha.MultiHeadAttentionBlock(8, 2, 0.0).eval())
    x = torch.randn(1, 3, 8)
    out, cache = block.forward_step(x[:, :1], None, None)
    out2, cache = block.forward_step(x[:, 1:], cache, None)
    torch.testing.assert_close(torch.cat([out, out2], 1), full_causal(block, x))


def test_mismatched_caches_are_rejected():
    block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0)
    with pytest.raises(RuntimeError, match=r"key_cache and value_cache must have shape \(batch, heads, T_past, d_k\)"):
        block.forward_step(torch.randn(1, 1, 8), (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 2, 4)))


@pytest.mark.parametrize("cache, got", [
    (lambda k, v: (k,), "a tuple of 1"),
    (lambda k, v: [k, v, v], "a list of 3"),
    (lambda k, v: k, r"a tensor of shape \[1, 2, 3, 4\]"),
    (lambda k, v: "kv", "str"),
], ids=["one", "three", "tensor", "string"])
def test_a_cache_that_is_not_a_pair_is_named(cache, got):
    block = fastmha.MultiHeadAttentionBlock(8, 2, 0.0)
    _, (k, v) = block.forward_step(torch.randn(1, 3, 8))
    with pytest.raises(RuntimeError, match=r"cache must be None or the \(key_cache, value_cache\) pair .*got " + got):
        block.forward_step(torch.randn(1, 1, 8), cache(k, v))
