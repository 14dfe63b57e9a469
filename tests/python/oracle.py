"""Independent oracle: multi-head attention written in plain PyTorch from the formulas.

scores = Q K^T / sqrt(d_k); scores[mask == 0] = -1e9; P = softmax(scores, -1); W = P * keep / (1 - p) when a
dropout keep-mask is given; output = W V. The block projects with bias-free weights (y = x W^T), splits
d_model into h heads of d_k, attends, merges the heads and projects with w_o.
"""

import math
from typing import Optional

import torch
from torch import Tensor, nn

MASKED_SCORE = -1e9


def oracle_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                     keep: Optional[Tensor] = None, p: float = 0.0):
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = torch.where(mask == 0, torch.full_like(scores, MASKED_SCORE), scores)
    probs = torch.softmax(scores, dim=-1)
    weights = probs if keep is None else probs * keep.to(probs.dtype) / (1.0 - p)
    return torch.matmul(weights, v), weights


class OracleBlock(nn.Module):
    """The block from the formulas, with the textbook class's parameter names (its state_dict keys).

    Dropout: an explicit keep-mask (tests that replay fastmha's mask), or, in training with dropout > 0 and
    no keep given, a fresh Bernoulli mask like nn.Dropout (the benchmark's and the demo's eager peer).
    """

    def __init__(self, d_model: int, h: int, dropout: float = 0.0):
        super().__init__()
        self.p = dropout
        self.h = h
        self.d_k = d_model // h
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.w_v = nn.Linear(d_model, d_model, bias=False)
        self.w_o = nn.Linear(d_model, d_model, bias=False)

    def split(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.reshape(b, length, self.h, self.d_k).permute(0, 2, 1, 3)

    def forward(self, q, k, v, mask=None, keep=None, p=None):
        if p is None:
            p = self.p
        if keep is None and self.training and p > 0:
            keep = torch.rand(q.size(0), self.h, q.size(1), k.size(1), device=q.device) >= p
        out, weights = oracle_attention(self.split(self.w_q(q)), self.split(self.w_k(k)), self.split(self.w_v(v)),
                                        mask, keep, p)
        b, _, length, _ = out.shape
        merged = out.permute(0, 2, 1, 3).reshape(b, length, self.h * self.d_k)
        return self.w_o(merged), weights
