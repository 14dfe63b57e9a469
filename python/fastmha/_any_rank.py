"""The static attention method on inputs of any rank from 2 up, as the textbook method's matmuls take them.

The core op takes (batch, h, L, d) tensors. Inputs (..., L, d) of another rank are viewed as a batch of single
heads (the leading dims flattened), the mask is shaped to match, and the results are shaped back.
"""

import math
from typing import List, Optional, Tuple

from torch import Tensor

from . import _module_checks


def _shapes(query: Tensor, key: Tensor, value: Tensor) -> str:
    return ("query " + _module_checks.shape(query) + ", key " + _module_checks.shape(key) + ", value "
            + _module_checks.shape(value))


def check_any_rank(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor]) -> None:
    """Shape checks in the caller's own shapes: one rank of 2 or more for all three, the same leading dims, the
    query's d_k for the key, one length for key and value; the mask broadcast to the scores (..., Lq, Lk)."""
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise RuntimeError("fastmha: query, key and value must have the same number of dims, at least 2 "
                           "(..., L, d), got " + _shapes(query, key, value))
    if key.shape[:-2] != query.shape[:-2] or value.shape[:-2] != query.shape[:-2]:
        raise RuntimeError("fastmha: query, key and value must have the same leading dims (all but the last two), "
                           "got " + _shapes(query, key, value))
    if key.shape[-1] != query.shape[-1] or query.shape[-1] == 0:
        raise RuntimeError("fastmha: key must have the query's head size d_k (last dim, positive), got "
                           + _shapes(query, key, value))
    if value.shape[-2] != key.shape[-2]:
        raise RuntimeError("fastmha: key and value must have the same length (dim -2), got "
                           + _shapes(query, key, value))
    scores = list(query.shape[:-1]) + [key.shape[-2]]
    _module_checks.check_mask(mask, query.device, scores)


def to_heads(query: Tensor, key: Tensor, value: Tensor,
             mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], List[int]]:
    """(query, key, value, mask) as the op's (batch, 1, L, d) tensors and a mask that broadcasts to their scores,
    and the leading dims to restore. Views where the layout allows (always for rank 2 and 3)."""
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _module_checks.check_dense(t, name)  # before sizes and a reshape, which sparse and nested tensors lack
    check_any_rank(query, key, value, mask)
    lead = list(query.shape[:-2])
    batch = math.prod(lead)
    heads = [t.reshape(batch, 1, t.shape[-2], t.shape[-1]) for t in (query, key, value)]
    if mask is not None and mask.dim() > 2:
        # The mask's leading dims line up with `lead` from the right and must be flattened like the inputs'. For
        # rank-3 inputs that is a view; for longer ones, where a leading dim of the mask is not 1, a copy (expanded
        # to `lead`).
        rows, cols = mask.shape[-2], mask.shape[-1]
        if mask.dim() == 3 and len(lead) == 1:
            mask = mask.unsqueeze(1)
        elif all(size == 1 for size in mask.shape[:-2]):
            mask = mask.reshape(1, 1, rows, cols)
        else:
            mask = mask.expand(lead + [rows, cols]).reshape(batch, 1, rows, cols)
    return heads[0], heads[1], heads[2], mask, lead


def from_heads(t: Tensor, lead: List[int]) -> Tensor:
    """One of the op's (batch, 1, Lq, n) results, output or weights, in the caller's leading dims."""
    return t.reshape(lead + [t.shape[-2], t.shape[-1]])
