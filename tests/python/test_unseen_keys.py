"""Keys that no query sees (padding): the block leaves their projections out where that changes nothing, and
projects them where it does: rows scored at or below -1e9 everywhere, and projections that are not finite."""

import pytest
import torch
from conftest import TOLERANCES
from oracle import OracleBlock

import fastmha

D_MODEL, HEADS = 8, 2
SEEN_KEYS = [2, 3]  # per sentence, of 8 keys: the rest are masked for every query


def padding_mask(len_k=8, device="cpu"):
    seen = torch.arange(len_k, device=device)[None, :] < torch.tensor(SEEN_KEYS, device=device)[:, None]
    return seen[:, None, None, :].to(torch.int64)


def identity_blocks(dtype, device):
    """fastmha's block and the oracle with identity weights, so that the inputs are the projections."""
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.0, reuse_projections=False).to(device, dtype)
    with torch.no_grad():
        for linear in (block.w_q, block.w_k, block.w_v, block.w_o):
            linear.weight.copy_(torch.eye(D_MODEL))
    oracle = OracleBlock(D_MODEL, HEADS).to(device, torch.float64)
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    return block, oracle


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rows_scored_below_the_fill_weigh_the_unseen_keys(device, dtype):
    """Queries whose visible scores are all about -3e9 give the masked keys (-1e9) all the weight: the output is
    the mean of the unseen keys' values, so those must be projected."""
    block, oracle = identity_blocks(dtype, device)
    q = torch.randn(2, 5, D_MODEL, dtype=dtype, device=device)
    k = torch.randn(2, 8, D_MODEL, dtype=dtype, device=device)
    v = torch.randn(2, 8, D_MODEL, dtype=dtype, device=device)
    scale = 7.8e4  # a score of -(scale^2) * 4 / sqrt(4) = -1.2e10 at every seen key
    q[0] = -scale
    k[0, : SEEN_KEYS[0]] = scale
    q_grad, k_grad, v_grad = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = block(q_grad, k_grad, v_grad, padding_mask(device=device))
    ref = oracle(q.double(), k.double(), v.double(), padding_mask(device=device))[0]
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])
    # Sentence 0's rows are the mean of its unseen keys' values (the identity w_o leaves them as they are).
    torch.testing.assert_close(out[0].double(), v[0, SEEN_KEYS[0]:].double().mean(0).expand(5, -1),
                               **TOLERANCES[dtype])
    block.attention_scores.sum().backward()  # the weights' gradient runs the backward over every key
    assert torch.isfinite(v_grad.grad).all()


def test_kept_projections_redone_when_later_queries_weigh_unseen_keys():
    """The block reusing kept key and value projections (gradients off) projects every key again for a call
    whose queries give the unseen keys weight."""
    block, oracle = identity_blocks(torch.float64, "cpu")
    block.reuse_projections = True
    block.eval()
    memory = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    memory[0, : SEEN_KEYS[0]] = 7.8e4
    mask = padding_mask()
    with torch.no_grad():
        for length, sign in ((2, 1.0), (3, -1.0), (4, 1.0)):  # the second call scores the seen keys at -1.2e10
            x = torch.randn(2, length, D_MODEL, dtype=torch.float64)
            x[0] = sign * 7.8e4
            out = block(x, memory, memory, mask)
            ref = oracle(x, memory, memory, mask)[0]
            torch.testing.assert_close(out, ref, **TOLERANCES[torch.float64])


def test_value_projection_overflowing_float16_gives_nan_as_the_math_does():
    """An unseen value row whose float16 projection overflows is inf: its zero weight makes the output of its
    sentence NaN, as with every projection computed (the other sentence is unaffected)."""
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.0).to(torch.float16)
    with torch.no_grad():
        for linear in (block.w_q, block.w_k, block.w_v, block.w_o):
            linear.weight.fill_(0.25)
    oracle = OracleBlock(D_MODEL, HEADS).to(torch.float64)
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    q = torch.randn(2, 5, D_MODEL, dtype=torch.float16)
    k = torch.randn(2, 8, D_MODEL, dtype=torch.float16)
    v = torch.randn(2, 8, D_MODEL, dtype=torch.float16)
    v[1, -1] = 6e4  # finite; its projection, 8 * 0.25 * 6e4, is not
    with torch.no_grad():
        assert torch.isinf(torch.nn.functional.linear(v, block.w_v.weight)[1, -1]).all()
        out = block(q, k, v, padding_mask())
        ref = oracle(q.double(), k.double(), v.double(), padding_mask())[0]
    assert out[1].isnan().all()
    torch.testing.assert_close(out[0].double(), ref[0], **TOLERANCES[torch.float16])


def test_kept_projections_not_reused_under_a_mask_that_sees_other_keys():
    """Kept projections leave out the keys their call's mask hid: a later call whose mask shows them projects
    again (and one with an equal mask, even a new tensor, reuses them)."""
    block, oracle = identity_blocks(torch.float64, "cpu")
    with torch.no_grad():
        for linear in (block.w_q, block.w_k, block.w_v, block.w_o):
            linear.weight.normal_()
    oracle.load_state_dict(block.state_dict())
    block.reuse_projections = True
    block.eval()
    memory = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    every_key = torch.ones(2, 1, 1, 8, dtype=torch.int64)
    with torch.no_grad():
        for length, mask in ((2, padding_mask()), (3, every_key), (4, padding_mask()), (5, padding_mask())):
            x = torch.randn(2, length, D_MODEL, dtype=torch.float64)
            out = block(x, memory, memory, mask)
            torch.testing.assert_close(out, oracle(x, memory, memory, mask)[0], **TOLERANCES[torch.float64])
