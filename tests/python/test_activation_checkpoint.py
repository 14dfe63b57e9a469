"""Activation checkpointing and saved-tensor hooks around the block: torch.utils.checkpoint (reentrant or not)
re-runs the forward in the backward, so the replayed dropout must draw the same mask, and the autograd node's
saved tensors (its projections among them) go through the hooks. Gradients against the oracle block without
dropout, and against the same block without checkpointing with it."""

import pytest
import torch
from oracle import OracleBlock
from torch.utils.checkpoint import checkpoint

import fastmha


def gradients(block, forward, x):
    inputs = x.clone().requires_grad_()
    block.zero_grad()
    torch.manual_seed(1)  # one dropout draw for every variant
    out = forward(inputs)
    (out if isinstance(out, torch.Tensor) else out[0]).square().sum().backward()
    return [inputs.grad] + [p.grad.clone() for p in block.parameters()]


def setup(dropout):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(16, 4, dropout).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.int64)
    mask[1, ..., 3:] = 0
    return block, x, mask


VARIANTS = {
    "checkpoint": lambda block, mask: lambda z: checkpoint(block, z, z, z, mask, use_reentrant=False),
    "reentrant checkpoint": lambda block, mask: lambda z: checkpoint(block, z, z, z, mask, use_reentrant=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS) + ["save_on_cpu"])
def test_checkpointed_block_matches_the_oracle(variant):
    block, x, mask = setup(0.0)
    oracle = OracleBlock(16, 4).double()
    oracle.load_state_dict(block.state_dict())
    if variant == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            got = gradients(block, lambda z: block(z, z, z, mask), x)
    else:
        got = gradients(block, VARIANTS[variant](block, mask), x)
    want = gradients(oracle, lambda z: oracle(z, z, z, mask), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_replays_the_dropout_draw(variant):
    block, x, mask = setup(0.3)
    plain = gradients(block, lambda z: block(z, z, z, mask), x)
    got = gradients(block, VARIANTS[variant](block, mask), x)
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b)


def test_gradient_penalty_through_a_checkpointed_block():
    block, x, mask = setup(0.0)
    oracle = OracleBlock(16, 4).double()
    oracle.load_state_dict(block.state_dict())
    results = []
    for forward in (lambda z: checkpoint(block, z, z, z, mask, use_reentrant=False),
                    lambda z: oracle(z, z, z, mask)[0]):
        inputs = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(forward(inputs).square().sum(), inputs, create_graph=True)
        grad.square().sum().backward()
        results.append(inputs.grad)
    torch.testing.assert_close(results[0], results[1])
