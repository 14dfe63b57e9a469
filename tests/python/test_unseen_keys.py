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
    (out.sum() + block.attention_scores.sum()).backward()  # the weights' gradient runs the backward over every key
    assert all(torch.isfinite(t.grad).all() for t in (q_grad, k_grad, v_grad))


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


def forcing_inputs(dtype, device, below_fill):
    """Inputs for identity blocks; with below_fill, sentence 0's queries score every seen key at -1.2e10."""
    q = torch.randn(2, 5, D_MODEL, dtype=dtype, device=device)
    k = torch.randn(2, 8, D_MODEL, dtype=dtype, device=device)
    v = torch.randn(2, 8, D_MODEL, dtype=dtype, device=device)
    k[0, : SEEN_KEYS[0]] = 7.8e4
    q[0] = -7.8e4 if below_fill else 7.8e4
    return q, k, v


def test_second_run_draws_the_same_dropout(device):
    """When the unseen keys turn out to weigh something, the attention runs again with every key projected: with
    the same dropout draw, and the generator left as one run leaves it."""
    block, _ = identity_blocks(torch.float64, device)
    block.dropout.p = 0.5
    block.train()
    runs = {}
    for below_fill in (False, True):
        inputs = forcing_inputs(torch.float64, device, below_fill)
        torch.manual_seed(7)
        block(*inputs, padding_mask(device=device))
        runs[below_fill] = (block.attention_scores[1] == 0, torch.rand(3, device=device))
    # Sentence 1 has the same scores in both calls: the same weights are dropped, and the generator moved alike.
    assert torch.equal(runs[False][0], runs[True][0])
    assert torch.equal(runs[False][1], runs[True][1])


def test_query_row_seeing_no_key_spreads_over_every_key(device):
    block, oracle = identity_blocks(torch.float32, device)
    q, k, v = forcing_inputs(torch.float32, device, below_fill=False)
    mask = padding_mask(device=device).repeat(1, 1, 5, 1)
    mask[1, 0, 2] = 0  # query 2 of sentence 1 sees no key: uniform over all 8
    out = block(q, k, v, mask)
    ref = oracle(q.double(), k.double(), v.double(), mask)[0]
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[torch.float32])
    torch.testing.assert_close(out[1, 2], v[1].mean(0), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_shape", ["padding", "3-d", "batch of 1"])
def test_without_kept_weights_and_other_mask_shapes(device, dtype, mask_shape):
    block, oracle = identity_blocks(dtype, device)
    block.need_weights = False
    with torch.no_grad():
        for linear in (block.w_q, block.w_k, block.w_v, block.w_o):
            linear.weight.normal_(std=0.3)
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    q, k, v = (torch.randn(2, n, D_MODEL, dtype=dtype, device=device) for n in (5, 8, 8))
    mask = padding_mask(device=device)
    if mask_shape == "3-d":
        mask = mask[:1, 0]  # (1, 1, 8) lines up with (h, Lq, Lk): both sentences see sentence 0's keys
    elif mask_shape == "batch of 1":
        mask = mask[1:]
    q_grad, k_grad, v_grad = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = block(q_grad, k_grad, v_grad, mask)
    out.sum().backward()
    q_ref, k_ref, v_ref = (t.double().requires_grad_(True) for t in (q, k, v))
    ref = oracle(q_ref, k_ref, v_ref, mask)[0]
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref.detach(), **TOLERANCES[dtype])
    for got, want in ((q_grad, q_ref), (k_grad, k_ref), (v_grad, v_ref)):
        torch.testing.assert_close(got.grad.double(), want.grad, **TOLERANCES[dtype])


def test_reuse_after_a_second_run_is_bit_for_bit_the_blocks_own():
    """A first call that had to project every key keeps the seen rows as the block projects them: later reuse
    gives the same numbers as a block that projects afresh."""
    block, _ = identity_blocks(torch.float64, "cpu")
    fresh, _ = identity_blocks(torch.float64, "cpu")
    for b in (block, fresh):
        with torch.no_grad():
            for linear in (b.w_q, b.w_k, b.w_v, b.w_o):
                linear.weight.copy_(torch.eye(D_MODEL) + 0.01 * torch.arange(D_MODEL * D_MODEL).view(8, 8).sin())
        b.eval()
    block.reuse_projections = True
    _, memory, _ = forcing_inputs(torch.float64, "cpu", below_fill=True)
    mask = padding_mask()
    with torch.no_grad():
        for below_fill in (True, False, False):
            x = forcing_inputs(torch.float64, "cpu", below_fill)[0]
            assert torch.equal(block(x, memory, memory, mask), fresh(x, memory, memory, mask))


def test_reuse_that_falls_back_draws_the_same_dropout():
    """Reuse of kept projections with dropout: a call whose queries weigh the unseen keys goes to the block's op
    with the generator put back, so it draws what a block without reuse draws."""
    blocks = [identity_blocks(torch.float64, "cpu")[0] for _ in range(2)]
    blocks[0].reuse_projections = True
    _, memory, _ = forcing_inputs(torch.float64, "cpu", below_fill=True)
    results = []
    for block in blocks:
        block.dropout.p = 0.5
        block.train()
        with torch.no_grad():
            block(forcing_inputs(torch.float64, "cpu", False)[0], memory, memory, padding_mask())
            torch.manual_seed(11)
            out = block(forcing_inputs(torch.float64, "cpu", True)[0], memory, memory, padding_mask())
        results.append((out, block.attention_scores, torch.rand(3)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", ["nan", "inf", "overflow", "overflow, strided weight"])
@pytest.mark.parametrize("d_model", [D_MODEL, 40])
def test_unseen_value_row_not_finite_or_overflowing_reaches_its_sentence_as_in_the_math(dtype, case, d_model):
    """An unseen value row that is NaN or infinite, or finite with a projection beyond the dtype's range, gives its
    zero weight a NaN product: the math's output of that sentence is NaN, in every dtype (the block's bound on the
    unseen rows' projections must see it and project them); the other sentence is unaffected. At d_model 40 the
    large entries sit in the first 32 features, which the bound reads in 16-wide steps, the NaN in one and the
    infinity after them; a weight of column stride d_model is read as well as a contiguous one."""
    wide = min(d_model, 32)
    block = fastmha.MultiHeadAttentionBlock(d_model, HEADS, 0.0, reuse_projections=False).to(dtype)
    with torch.no_grad():
        for linear in (block.w_q, block.w_k, block.w_v, block.w_o):
            linear.weight.zero_()
            linear.weight[:, :wide] = 0.25  # every row of W sums |w| to wide / 4
        if case == "overflow, strided weight":
            strided = torch.empty(d_model, d_model, dtype=dtype).t()
            block.w_v.weight = torch.nn.Parameter(strided.copy_(block.w_v.weight))
    oracle = OracleBlock(d_model, HEADS).to(torch.float64)
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    q, k, v = (torch.randn(2, n, d_model, dtype=dtype) for n in (5, 8, 8))
    largest = torch.finfo(dtype).max
    if case.startswith("overflow"):
        v[1, -1, :wide] = 0.75 * largest  # finite; its projection, wide / 4 * 0.75 of the largest value, is not
    elif case == "nan":
        v[1, -1, 3] = float("nan")
    else:
        v[1, -1, d_model - 2] = -float("inf")
    with torch.no_grad():
        if case.startswith("overflow"):
            assert torch.isinf(torch.nn.functional.linear(v, block.w_v.weight)[1, -1]).all()
        out = block(q, k, v, padding_mask())
        ref = oracle(q.double(), k.double(), v.double(), padding_mask())[0]
    assert out[1].isnan().all()
    torch.testing.assert_close(out[0].double(), ref[0], **TOLERANCES[dtype])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_mask_expanded_along_the_keys_sees_every_key_or_none(device, mask_dtype):
    """A mask with the same value at every key (a (B, 1, Lq, 1) mask expanded to Lk keys, stride 0 there): each row
    sees all keys or none, so every key is projected; the block matches the oracle."""
    torch.manual_seed(0)
    block, oracle = identity_blocks(torch.float64, device)
    q = torch.randn(2, 5, D_MODEL, dtype=torch.float64, device=device)
    k = torch.randn(2, 64, D_MODEL, dtype=torch.float64, device=device)
    rows = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], device=device).to(mask_dtype)
    mask = rows[:, None, :, None].expand(2, 1, 5, 64)
    out = block(q, k, k, mask)
    torch.testing.assert_close(out, oracle(q, k, k, mask)[0])
