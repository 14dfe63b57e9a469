"""Functional Python API over torch.ops.fastmha (weights come back as None when not requested)."""

from typing import Optional, Tuple

import torch
from torch import Tensor


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    need_weights: bool = True,
    is_causal: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention on split heads: query (batch, h, Lq, d_k), key (batch, h, Lk, d_k), value (batch, h, Lk, d_v).

    scores = query @ key^T / sqrt(d_k); where mask == 0 the score is -1e9; softmax over keys; dropout with
    probability dropout_p on the weights; is_causal adds the top-left causal mask (key j <= query i) without
    materializing it. Returns (weights @ value, weights or None).
    """
    output, weights = torch.ops.fastmha.attention(query, key, value, mask, dropout_p, need_weights, is_causal)
    return output, (weights if need_weights else None)


def multi_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    w_q: Tensor,
    w_k: Tensor,
    w_v: Tensor,
    w_o: Tensor,
    num_heads: int,
    mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    need_weights: bool = True,
    is_causal: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The whole block on batch-first (batch, seq, d_model) inputs with bias-free (d_model, d_model) weights.

    Returns (output (batch, Lq, d_model), weights (batch, num_heads, Lq, Lk) or None).
    """
    output, weights = torch.ops.fastmha.multi_head_attention(
        query, key, value, w_q, w_k, w_v, w_o, num_heads, mask, dropout_p, need_weights, is_causal
    )
    return output, (weights if need_weights else None)


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    need_weights: bool = True,
    is_causal: bool = False,
) -> str:
    """Which kernels ``attention(query, key, value, mask, dropout_p, need_weights, is_causal)`` runs, and why.

    Returns two lines, ``"forward <kernel>: <reason>"`` and ``"backward <kernel>: <reason>"``; a kernel is one of
    ``fastmha-cpu``, ``torch-cpu-flash``, ``fastmha-cuda``, ``torch-cuda-sdpa`` and ``aten-composite``. The
    backward line is the backward of a loss that does not read the kept weights (the usual case; on CPU a loss
    that reads them runs ``fastmha-cpu``). The block (``multi_head_attention``) makes the same choices for its
    heads-split tensors. Set
    ``FASTMHA_LOG_KERNELS=1`` to have every call print its choice to stderr.
    """
    return torch.ops.fastmha._explain(query, key, value, mask, dropout_p, need_weights, is_causal)
