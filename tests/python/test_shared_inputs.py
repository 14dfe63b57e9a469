"""One tensor passed as more than one of query, key and value (self-attention's x, cross-attention's memory): the
block's backward adds that tensor's gradients up in its products and autograd hands the sum to it once. Against
autograd through the float64 oracle given the same tensors, and against gradcheck's finite differences."""

import pytest
import torch
from conftest import TOLERANCES
from oracle import OracleBlock

import fastmha

D_MODEL, HEADS, LENGTH = 16, 2, 9
KEPT = [3, 2]  # per sentence: positions whose keys are seen and whose outputs the loss reads
# Which of two tensors (0, 1) the block takes as query, key and value.
SHARINGS = {"query, key and value": (0, 0, 0), "key and value": (0, 1, 1), "query and key": (0, 0, 1),
            "query and value": (0, 1, 0)}
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def padded_case(dtype, device):
    """Two inputs, a (batch, 1, 1, L) padding mask, and loss weights that are zero at padded positions: the
    projections' gradients are zero in most rows, so the backward multiplies only the others."""
    tensors = [torch.randn(2, LENGTH, D_MODEL, dtype=dtype, device=device) for _ in range(2)]
    kept = torch.arange(LENGTH, device=device)[None, :] < torch.tensor(KEPT, device=device)[:, None]
    loss_weights = torch.randn(2, LENGTH, D_MODEL, dtype=dtype, device=device) * kept[..., None]
    return tensors, kept[:, None, None, :].to(torch.int64), loss_weights


def block_and_oracle(dtype, device):
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.0).to(device, dtype)
    oracle = OracleBlock(D_MODEL, HEADS).to(device, torch.float64)
    oracle.load_state_dict({name: t.double() for name, t in block.state_dict().items()})
    return block, oracle


def edges_to(out, leaf):
    """How many of the autograd edges of out's node lead to `leaf`."""
    return sum(1 for node, _ in out.grad_fn.next_functions if node is not None and getattr(node, "variable", None) is leaf)


def gradients(block, tensors, sharing, mask, loss_weights):
    """The leaves' gradients (None for one the block did not take) and the four weights'."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = block(*(leaves[i] for i in sharing), mask)
    if isinstance(out, tuple):  # the oracle
        out = out[0]
    else:  # a tensor the block takes several times is one input of its node, which sums its gradients
        for i, leaf in enumerate(leaves):
            assert edges_to(out, leaf) == (1 if i in sharing else 0)
    (out * loss_weights).sum().backward()
    return [leaf.grad for leaf in leaves] + [getattr(block, n).weight.grad for n in ("w_q", "w_k", "w_v", "w_o")]


def assert_match(got, want, dtype):
    for name, g, w in zip(["first", "second", "w_q", "w_k", "w_v", "w_o"], got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g.double(), w, **TOLERANCES[dtype], msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sharing", list(SHARINGS))
@pytest.mark.parametrize("masked", [False, True])
def test_gradients_of_a_shared_input_match_the_oracle(device, dtype, sharing, masked):
    torch.manual_seed(11)
    block, oracle = block_and_oracle(dtype, device)
    tensors, mask, loss_weights = padded_case(dtype, device)
    if not masked:
        mask, loss_weights = None, torch.randn_like(loss_weights)
    got = gradients(block, tensors, SHARINGS[sharing], mask, loss_weights)
    want = gradients(oracle, [t.double() for t in tensors], SHARINGS[sharing], mask, loss_weights.double())
    assert_match(got, want, dtype)
    if masked:  # padded positions get no gradient, whichever inputs they were
        for grad in got[:2]:
            if grad is not None:
                for b, kept in enumerate(KEPT):
                    assert (grad[b, kept:] == 0).all()


@pytest.mark.parametrize("sharing", list(SHARINGS))
def test_gradcheck_of_a_shared_input(device, sharing):
    torch.manual_seed(12)
    tensors = [torch.randn(2, 5, 8, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2)]
    weights = [torch.randn(8, 8, dtype=torch.float64, device=device, requires_grad=True) / 3 for _ in range(4)]
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 1]], device=device)[:, None, None, :]
    index = SHARINGS[sharing]

    def block(a, b, *ws):
        pair = (a, b)
        return torch.ops.fastmha.multi_head_attention(pair[index[0]], pair[index[1]], pair[index[2]], *ws, 2, mask,
                                                      0.0, True, False)

    assert torch.autograd.gradcheck(block, (*tensors, *weights))
    assert torch.autograd.gradgradcheck(block, (*tensors, *weights))


def test_saved_tensors_unpacked_as_copies_give_the_same_gradients(device):
    # The forward records which inputs were one tensor: saved-tensor hooks that unpack copies (as offloading does)
    # leave the sum as it is.
    torch.manual_seed(13)
    block, oracle = block_and_oracle(torch.float32, device)
    tensors, mask, loss_weights = padded_case(torch.float32, device)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        got = gradients(block, tensors, SHARINGS["query, key and value"], mask, loss_weights)
    want = gradients(oracle, [t.double() for t in tensors], SHARINGS["query, key and value"], mask,
                     loss_weights.double())
    assert_match(got, want, torch.float32)


def test_a_loss_on_the_weights_alone_with_one_input(device):
    # Only the kept weights reach the loss: the query and key sides get their gradient, summed for the one input;
    # w_v and w_o get none, as in the textbook block.
    torch.manual_seed(14)
    block, oracle = block_and_oracle(torch.float64, device)
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, device=device)
    grad = torch.randn(2, HEADS, LENGTH, LENGTH, dtype=torch.float64, device=device)
    leaf, oracle_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    block(leaf, leaf, leaf, None)
    block.attention_scores.backward(grad)
    oracle(oracle_leaf, oracle_leaf, oracle_leaf)[1].backward(grad)
    torch.testing.assert_close(leaf.grad, oracle_leaf.grad, **TOLERANCES[torch.float64])
    assert block.w_v.weight.grad is None and block.w_o.weight.grad is None
    for name in ("w_q", "w_k"):
        torch.testing.assert_close(getattr(block, name).weight.grad, getattr(oracle, name).weight.grad,
                                   **TOLERANCES[torch.float64])


@pytest.mark.parametrize("sharing", list(SHARINGS))
def test_autocast_casts_a_shared_input_once(device, sharing):
    # Under autocast the block casts one float32 tensor passed several times once: its node has one edge to that
    # cast, and the input gets the oracle's gradient.
    torch.manual_seed(15)
    block, oracle = block_and_oracle(torch.float32, device)
    tensors, mask, loss_weights = padded_case(torch.float32, device)
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    with torch.autocast(device, dtype=torch.bfloat16):
        out = block(*(leaves[i] for i in SHARINGS[sharing]), mask)
    assert out.dtype == torch.bfloat16
    casts = [node for node, _ in out.grad_fn.next_functions if node is not None and "ToCopy" in node.name()]
    assert len(casts) == len(set(SHARINGS[sharing])) + 4  # one per tensor and weight, not per input
    (out.float() * loss_weights).sum().backward()
    want = gradients(oracle, [t.double() for t in tensors], SHARINGS[sharing], mask, loss_weights.double())
    for leaf, expected in zip(leaves, want[:2]):
        assert (leaf.grad is None) == (expected is None)
        if expected is not None:
            torch.testing.assert_close(leaf.grad.double(), expected, **TOLERANCES[torch.bfloat16])
