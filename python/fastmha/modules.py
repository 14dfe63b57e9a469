"""fastmha.MultiHeadAttentionBlock: a drop-in for the textbook MultiHeadAttentionBlock(d_model, h, dropout)."""

from typing import Optional, Tuple

import torch
from torch import Tensor, nn


class MultiHeadAttentionBlock(nn.Module):
    """Multi-head attention with the textbook block's constructor, attributes, parameters and numbers.

    Parameters (state_dict keys) are ``w_q.weight``, ``w_k.weight``, ``w_v.weight``, ``w_o.weight``: four
    bias-free ``nn.Linear(d_model, d_model)``. ``forward(q, k, v, mask)`` takes batch-first
    ``(batch, seq, d_model)`` tensors; where ``mask == 0`` (any dtype, broadcastable to
    ``(batch, h, Lq, Lk)``) the score is set to -1e9 before the softmax. After each forward,
    ``attention_scores`` holds the post-dropout weights ``(batch, h, Lq, Lk)``, or None when
    ``need_weights`` is False (which also saves their memory). With ``is_causal=True`` query i attends keys
    j <= i only (top-left aligned when Lq != Lk), exactly as if ``tril(ones(Lq, Lk))`` were added to the mask,
    without materializing it (the kernels skip the masked key blocks).
    """

    attention_scores: Optional[Tensor]

    def __init__(
        self, d_model: int, h: int, dropout: float, need_weights: bool = True, is_causal: bool = False
    ) -> None:
        """``d_model`` features split into ``h`` heads of ``d_k = d_model // h``; ``dropout`` is the probability
        of dropping an attention weight in training (an ``nn.Dropout``, so 1.0 drops them all). With
        ``need_weights=False`` the weights are not kept (``attention_scores`` stays None, and their memory is
        saved); with ``is_causal=True`` query i attends keys j <= i only. Raises ValueError for sizes that
        are not positive ints, ``d_model % h != 0``, or a dropout outside [0, 1].
        """
        super().__init__()
        if not isinstance(d_model, int) or d_model <= 0:
            raise ValueError(f"fastmha: d_model must be a positive int, got {d_model!r}")
        if not isinstance(h, int) or h <= 0:
            raise ValueError(f"fastmha: h must be a positive int, got {h!r}")
        if d_model % h != 0:
            raise ValueError(f"fastmha: d_model must be divisible by h, got d_model={d_model} and h={h}")
        if not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"fastmha: dropout must be in [0, 1], got {dropout!r}")
        self.d_model = d_model
        self.h = h
        self.d_k = d_model // h
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.w_v = nn.Linear(d_model, d_model, bias=False)
        self.w_o = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.need_weights = need_weights
        self.is_causal = is_causal
        self.attention_scores = None

    @staticmethod
    def attention(
        query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], dropout: Optional[nn.Dropout]
    ) -> Tuple[Tensor, Tensor]:
        """The textbook static method: inputs (batch, h, seq, d_k); returns (weights @ value, weights).

        ``dropout`` is an ``nn.Dropout`` (applied only while it is in training mode) or None.
        """
        p = dropout.p if dropout is not None and dropout.training else 0.0
        output, weights = torch.ops.fastmha.attention(query, key, value, mask, p if p < 1.0 else 0.0, True)
        if p >= 1.0:  # nn.Dropout(1.0) drops every weight
            return output * 0.0, weights * 0.0
        return output, weights

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Attention of queries ``q`` (batch, Lq, d_model) over keys ``k`` and values ``v`` (batch, Lk, d_model).

        Where ``mask == 0`` (any dtype, broadcastable to (batch, h, Lq, Lk), e.g. a (batch, 1, 1, Lk) padding
        mask) the score is -1e9 before the softmax. Returns (batch, Lq, d_model) and keeps the post-dropout
        weights (batch, h, Lq, Lk) in ``attention_scores`` when ``need_weights`` is True.
        """
        p = self.dropout.p if self.dropout.training else 0.0
        output, weights = torch.ops.fastmha.multi_head_attention(
            q, k, v, self.w_q.weight, self.w_k.weight, self.w_v.weight, self.w_o.weight,
            self.h, mask, p if p < 1.0 else 0.0, self.need_weights, self.is_causal,
        )
        if p >= 1.0:  # nn.Dropout(1.0) drops every weight: zero weights, zero output
            output, weights = output * 0.0, weights * 0.0
        self.attention_scores = weights if self.need_weights else None
        return output

    @torch.jit.export
    def forward_step(
        self, x: Tensor, cache: Optional[Tuple[Tensor, Tensor]] = None, mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """Incremental decoding of a decoder's self-attention: ``x`` (batch, T_new, d_model) are new positions,
        ``cache`` the (key, value) tensors (batch, h, T_past, d_k) returned by the previous step (None at the
        start). Each new position attends the cached positions and the new ones up to itself, and where ``mask``
        (broadcastable to (batch, h, T_new, T_past + T_new)) is not 0. Returns (output, new cache). Stepping
        through a sequence gives the same outputs as ``forward`` with a causal mask, with O(T_new) projections
        per step (except for a position whose every visible key is masked: the full computation spreads it
        uniformly over all positions, future ones included, which a step cannot see). ``attention_scores`` is
        left as it was.
        """
        key_cache: Optional[Tensor] = None
        value_cache: Optional[Tensor] = None
        if cache is not None:
            key_cache, value_cache = cache
        p = self.dropout.p if self.dropout.training else 0.0
        output, keys, values = torch.ops.fastmha.multi_head_attention_step(
            x, self.w_q.weight, self.w_k.weight, self.w_v.weight, self.w_o.weight, self.h,
            key_cache, value_cache, mask, p if p < 1.0 else 0.0,
        )
        if p >= 1.0:  # nn.Dropout(1.0) drops every weight
            output = output * 0.0
        return output, (keys, values)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, h={self.h}, d_k={self.d_k}, need_weights={self.need_weights}, "
                f"is_causal={self.is_causal}")
