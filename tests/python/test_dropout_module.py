"""The block calls its dropout module on the attention weights, as the textbook block does, when the op cannot
apply it itself: another module in its place (a dropout of the user's) or a hook on it. An nn.Identity or None in
its place means no dropout, which the op applies. Checked against the oracle block given the same keep-mask, and
against the oracle's weights passed through the same hook."""

from typing import Tuple

import pytest
import torch
from conftest import OpCounter, assert_close
from oracle import OracleBlock, oracle_attention
from torch import Tensor, nn

import fastmha

D_MODEL, HEADS, LENGTH = 16, 2, 5


class FixedKeepDropout(nn.Module):
    """A user's dropout: drops where `keep` is False and scales the rest by 1 / (1 - p), like nn.Dropout."""

    def __init__(self, keep: Tensor, p: float):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, weights: Tensor) -> Tensor:
        return weights * self.keep.to(weights.dtype) / (1.0 - self.p)


def double_output(module: nn.Module, args: Tuple[Tensor], output: Tensor) -> Tensor:
    return output * 2.0


def pair(dropout=0.1, dtype=torch.float64, **kwargs):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, dropout, **kwargs).to(dtype)
    oracle = OracleBlock(D_MODEL, HEADS).double()
    oracle.load_state_dict(block.state_dict())  # the block's (possibly rounded) weights, in float64
    return block, oracle


def inputs(dtype=torch.float64):
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64).to(dtype).requires_grad_()
    mask = torch.ones(2, 1, 1, LENGTH, dtype=torch.int64)
    mask[1, ..., 3:] = 0
    return x, mask


def fixed_keep(p):
    return torch.rand(2, HEADS, LENGTH, LENGTH, generator=torch.Generator().manual_seed(3)) >= p


def oracle_with_doubled_weights(oracle, x, mask):
    """The oracle block with its weights doubled after the softmax, as a hook on the dropout doubles them."""
    q, k, v = (oracle.split(linear(x)) for linear in (oracle.w_q, oracle.w_k, oracle.w_v))
    _, probs = oracle_attention(q, k, v, mask)
    heads_out = torch.matmul(probs * 2.0, v)
    return oracle.w_o(heads_out.transpose(1, 2).reshape(x.shape[0], x.shape[1], D_MODEL)), probs * 2.0


def assert_matches(block, oracle_out, oracle_weights, x, xo, mask, dtype=torch.float64):
    """Output, kept weights and input gradient of the block against the oracle's."""
    out = block(x, x, x, mask)
    assert_close(out, oracle_out, dtype)
    if block.need_weights:
        assert_close(block.attention_scores, oracle_weights, dtype)
    else:
        assert block.attention_scores is None
    grad_out = torch.randn(out.shape, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, [x], grad_out.to(dtype))
    (want,) = torch.autograd.grad(oracle_out, [xo], grad_out)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("replacement", ["identity", "none"])
@pytest.mark.parametrize("training", [True, False])
def test_identity_or_none_in_the_dropouts_place_is_no_dropout(replacement, training):
    # Export and inference tools replace nn.Dropout by nn.Identity: no dropout, in training too, on the op's path.
    block, oracle = pair()
    block.dropout = nn.Identity() if replacement == "identity" else None
    block.train(training)
    x, mask = inputs()
    xo = x.detach().clone().requires_grad_()
    want, want_weights = oracle(xo, xo, xo, mask, p=0.0)
    names = OpCounter()
    with names:
        assert_matches(block, want, want_weights, x, xo, mask)
    assert "_multi_head_attention_forward" in names.names


@pytest.mark.parametrize("case", ["float64", "no weights kept", "causal", "bfloat16"])
def test_a_users_dropout_module_is_applied_to_the_weights(case):
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float64
    block, oracle = pair(dtype=dtype, need_weights=case != "no weights kept", is_causal=case == "causal")
    x, mask = inputs(dtype)
    keep = fixed_keep(0.3)
    block.dropout = FixedKeepDropout(keep, 0.3)
    xo = x.detach().double().requires_grad_()
    oracle_mask = mask * torch.ones(LENGTH, LENGTH, dtype=torch.int64).tril() if case == "causal" else mask
    want, want_weights = oracle(xo, xo, xo, oracle_mask, keep=keep, p=0.3)
    names = OpCounter()
    with names:
        assert_matches(block, want, want_weights, x, xo, mask, dtype)
    assert "_multi_head_attention_forward" not in names.names and "_attention_forward" in names.names


@pytest.mark.parametrize("training", [True, False])
def test_a_hook_on_the_dropout_runs_and_may_replace_the_weights(training):
    block, oracle = pair(dropout=0.0)
    seen = []

    def double(module, args, output):
        seen.append(output.shape)
        return output * 2.0

    block.dropout.register_forward_hook(double)
    block.train(training)
    x, mask = inputs()
    xo = x.detach().clone().requires_grad_()
    want, want_weights = oracle_with_doubled_weights(oracle, xo, mask)
    assert_matches(block, want, want_weights, x, xo, mask)
    assert seen == [torch.Size([2, HEADS, LENGTH, LENGTH])]


def test_global_hooks_see_the_dropout_called():
    block, _ = pair()
    called = []
    handle = nn.modules.module.register_module_forward_hook(lambda module, *args: called.append(type(module)))
    try:
        x, mask = inputs()
        block(x, x, x, mask)
    finally:
        handle.remove()
    assert called.count(nn.Dropout) == 1 and called.count(nn.Linear) == 4


def test_forward_step_calls_the_dropout_module_as_forward_does():
    # Stepping through a sequence gives forward's outputs with a causal mask, with the weights doubled by a hook.
    block, oracle = pair(dropout=0.0)
    calls = []
    block.dropout.register_forward_hook(lambda module, args, output: calls.append(1) or output * 2.0)
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    pad = torch.ones(2, 1, 1, 6, dtype=torch.int64)
    causal = torch.ones(6, 6, dtype=torch.int64).tril()
    with torch.no_grad():
        want, _ = oracle_with_doubled_weights(oracle, x, causal * pad)
        outputs, cache = [], None
        for t in range(6):
            out, cache = block.forward_step(x[:, t:t + 1], cache, pad[..., :t + 1])
            outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs, 1), want)
    assert len(calls) == 6


def test_static_attention_calls_the_module_it_is_given():
    q, k, v = (torch.randn(2, HEADS, LENGTH, 8, dtype=torch.float64) for _ in range(3))
    keep = fixed_keep(0.5)
    out, weights = fastmha.MultiHeadAttentionBlock.attention(q, k, v, None, FixedKeepDropout(keep, 0.5))
    want, want_weights = oracle_attention(q, k, v, None, keep, 0.5)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_weights)
    for no_dropout in (nn.Identity().train(), None):
        out, weights = fastmha.MultiHeadAttentionBlock.attention(q, k, v, None, no_dropout)
        want, want_weights = oracle_attention(q, k, v)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("replacement", ["identity", "none", "hooked", "user's"])
def test_scripted_block_applies_the_dropout_it_was_scripted_with(replacement):
    block, oracle = pair(dropout=0.0)
    keep = fixed_keep(0.25)
    if replacement == "identity":
        block.dropout = nn.Identity()
    elif replacement == "none":
        block.dropout = None
    elif replacement == "hooked":
        block.dropout.register_forward_hook(double_output)
    else:
        block.dropout = FixedKeepDropout(keep, 0.25)
    block.train()
    scripted = torch.jit.script(block)
    x, mask = inputs()
    with torch.no_grad():
        if replacement == "hooked":
            want, want_weights = oracle_with_doubled_weights(oracle, x, mask)
        else:
            users = replacement == "user's"
            want, want_weights = oracle(x, x, x, mask, keep=keep if users else None, p=0.25 if users else 0.0)
        torch.testing.assert_close(scripted(x, x, x, mask), want)
        torch.testing.assert_close(scripted.attention_scores, want_weights)
        if replacement != "user's":  # its keep-mask has the whole sequence's shape
            step, _ = scripted.forward_step(x[:, :2])
            torch.testing.assert_close(step, block.forward_step(x[:, :2])[0])


def test_a_user_dropout_with_an_integer_probability_scripts():
    block, _ = pair()
    block.dropout = FixedKeepDropout(fixed_keep(0.0), 0)
    torch.jit.script(block)
