"""fastmha.MultiHeadAttentionBlock as a drop-in for the textbook block, checked against the oracle block."""

import pytest
import torch
from conftest import assert_close
from oracle import OracleBlock, oracle_attention
from torch import nn

import fastmha

D_MODEL, HEADS = 24, 4


def make_pair(device, dtype=torch.float64, dropout=0.0, **kwargs):
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, dropout, **kwargs).to(device, dtype)
    oracle = OracleBlock(D_MODEL, HEADS).to(device, dtype)
    oracle.load_state_dict(block.state_dict(), strict=True)
    return block, oracle


def test_constructor_attributes_and_parameters():
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.25)
    assert (block.d_model, block.h, block.d_k) == (D_MODEL, HEADS, D_MODEL // HEADS)
    assert isinstance(block.dropout, nn.Dropout) and block.dropout.p == 0.25
    for name in ("w_q", "w_k", "w_v", "w_o"):
        layer = getattr(block, name)
        assert isinstance(layer, nn.Linear) and layer.bias is None
        assert layer.weight.shape == (D_MODEL, D_MODEL)
    assert list(block.state_dict()) == ["w_q.weight", "w_k.weight", "w_v.weight", "w_o.weight"]
    assert block.need_weights is True and block.attention_scores is None


def test_constructor_takes_numpy_integer_sizes():
    # Sizes read from a config array are numpy integers, which nn.Linear takes too.
    np = pytest.importorskip("numpy")
    block = fastmha.MultiHeadAttentionBlock(np.int64(D_MODEL), np.int32(HEADS), 0.0)
    assert (type(block.d_model), type(block.h), type(block.d_k)) == (int, int, int)
    assert (block.d_model, block.h, block.d_k) == (D_MODEL, HEADS, D_MODEL // HEADS)
    torch.jit.script(block)  # int attributes, as TorchScript needs


def test_state_dict_loads_both_ways_strict():
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.1)
    oracle = OracleBlock(D_MODEL, HEADS)
    block.load_state_dict(oracle.state_dict(), strict=True)
    for key, value in oracle.state_dict().items():
        assert torch.equal(block.state_dict()[key], value)
    other = OracleBlock(D_MODEL, HEADS)
    other.load_state_dict(block.state_dict(), strict=True)


def float64_oracle(block):
    oracle = OracleBlock(block.d_model, block.h).to(block.w_q.weight.device, torch.float64)
    oracle.load_state_dict({k: v.double() for k, v in block.state_dict().items()}, strict=True)
    return oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_self_attention_matches_oracle(device, dtype):
    block, _ = make_pair(device, dtype)
    x = torch.randn(3, 6, D_MODEL, device=device, dtype=dtype)
    out = block(x, x, x, None)
    ref_out, ref_weights = float64_oracle(block)(x.double(), x.double(), x.double())
    assert out.shape == (3, 6, D_MODEL) and out.dtype == dtype
    assert_close(out, ref_out, dtype)
    assert_close(block.attention_scores, ref_weights, dtype)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "decoder", "2d-causal"])
def test_cross_attention_with_masks_matches_oracle(device, mask_kind):
    block, oracle = make_pair(device)
    b, lq, lk = 2, 5, 8
    q = torch.randn(b, lq, D_MODEL, device=device, dtype=torch.float64)
    kv = torch.randn(b, lk, D_MODEL, device=device, dtype=torch.float64)
    mask = {
        "none": None,
        "padding": (torch.arange(lk, device=device) < torch.tensor([[6], [8]], device=device))[:, None, None, :],
        "decoder": torch.rand(b, 1, lq, lk, device=device) > 0.4,
        "2d-causal": torch.tril(torch.ones(lq, lk, device=device, dtype=torch.int32)),
    }[mask_kind]
    out = block(q, kv, kv, mask)
    ref_out, ref_weights = oracle(q, kv, kv, mask)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(block.attention_scores, ref_weights)


def test_distinct_q_k_v_tensors(device):
    block, oracle = make_pair(device)
    q, k, v = (torch.randn(2, n, D_MODEL, device=device, dtype=torch.float64) for n in (3, 4, 4))
    torch.testing.assert_close(block(q, k, v, None), oracle(q, k, v)[0])


def test_non_contiguous_module_inputs(device):
    block, oracle = make_pair(device)
    x = torch.randn(D_MODEL, 7, 2, device=device, dtype=torch.float64).permute(2, 1, 0)
    assert not x.is_contiguous()
    torch.testing.assert_close(block(x, x, x, None), oracle(x, x, x)[0])


def test_need_weights_false_keeps_no_weights(device):
    block, oracle = make_pair(device, need_weights=False)
    x = torch.randn(2, 5, D_MODEL, device=device, dtype=torch.float64)
    torch.testing.assert_close(block(x, x, x, None), oracle(x, x, x)[0])
    assert block.attention_scores is None
    block.need_weights = True  # a plain attribute, switchable after construction
    block(x, x, x, None)
    assert block.attention_scores.shape == (2, HEADS, 5, 5)


def test_static_attention_method(device):
    q, k, v = (torch.randn(2, 3, n, 4, device=device, dtype=torch.float64) for n in (5, 6, 6))
    mask = torch.rand(2, 1, 5, 6, device=device) > 0.3
    out, weights = fastmha.MultiHeadAttentionBlock.attention(q, k, v, mask, None)
    ref_out, ref_weights = oracle_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(weights, ref_weights)
    # An nn.Dropout in eval mode does nothing, as in the textbook.
    out_eval, _ = fastmha.MultiHeadAttentionBlock.attention(q, k, v, mask, nn.Dropout(0.5).eval())
    torch.testing.assert_close(out_eval, ref_out)


def test_eval_mode_disables_dropout(device):
    block, oracle = make_pair(device, dropout=0.5)
    block.eval()
    x = torch.randn(2, 6, D_MODEL, device=device, dtype=torch.float64)
    torch.testing.assert_close(block(x, x, x, None), oracle(x, x, x)[0])


def test_dropout_in_training_applies_the_stored_weights(device):
    p = 0.3
    block, oracle = make_pair(device, dropout=p)
    x = torch.randn(4, 16, D_MODEL, device=device, dtype=torch.float64)
    out = block(x, x, x, None)
    weights = block.attention_scores
    _, probs = oracle(x, x, x)
    keep = weights != 0
    # Kept weights are the softmax scaled by 1/(1-p); the output is exactly the stored weights applied.
    torch.testing.assert_close(weights[keep], probs[keep] / (1 - p))
    ref_out, _ = oracle(x, x, x, keep=keep, p=p)
    torch.testing.assert_close(out, ref_out)
    dropped = 1 - keep.double().mean().item()
    assert abs(dropped - p) < 0.03, dropped


def test_dropout_one_drops_every_weight_like_nn_dropout(device):
    # nn.Dropout(1.0) in training zeroes every weight, so the block's output is 0 and no gradient flows.
    block = fastmha.MultiHeadAttentionBlock(16, 4, 1.0).to(device).train()
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    out = block(x, x, x, None)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(block.attention_scores, torch.zeros(2, 4, 5, 5, device=device))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    q = torch.randn(2, 4, 5, 4, device=device)
    out, weights = fastmha.MultiHeadAttentionBlock.attention(q, q, q, None, block.dropout)
    assert not out.any() and not weights.any()
    block.eval()
    assert block(x, x, x, None).abs().sum() > 0


def test_dropout_is_reproducible_under_manual_seed(device):
    block, _ = make_pair(device, dtype=torch.float32, dropout=0.2)
    x = torch.randn(2, 9, D_MODEL, device=device)
    torch.manual_seed(123)
    first = block(x, x, x, None)
    first_weights = block.attention_scores
    second = block(x, x, x, None)
    torch.manual_seed(123)
    again = block(x, x, x, None)
    assert torch.equal(first, again) and torch.equal(first_weights, block.attention_scores)
    assert not torch.equal(first, second)


def test_dropout_statistics_of_the_core(device):
    q, k, v = (torch.randn(4, 4, 32, 8, device=device) for _ in range(3))
    for p in (0.1, 0.5, 0.9):
        _, weights = torch.ops.fastmha.attention(q, k, v, None, p, True)
        kept = (weights != 0).double().mean().item()
        assert abs(kept - (1 - p)) < 0.02, (p, kept)


def test_works_inside_a_model_and_trains(device):
    block = fastmha.MultiHeadAttentionBlock(D_MODEL, HEADS, 0.0).to(device)
    head = nn.Linear(D_MODEL, 1).to(device)
    opt = torch.optim.Adam(list(block.parameters()) + list(head.parameters()), lr=1e-2)
    x = torch.randn(8, 6, D_MODEL, device=device)
    target = x.sum(dim=(1, 2), keepdim=False)[:, None] * 0.01
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (head(block(x, x, x, None).mean(1)) - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
