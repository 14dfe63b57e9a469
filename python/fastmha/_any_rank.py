"""The static attention method on inputs of any rank from 2 up, as the textbook method's matmuls take them.

The core op takes (batch, h, L, d) tensors of one batch. Inputs (..., L, d) of another rank, or whose leading dims
differ but broadcast (keys shared by every head, one memory for a batch of queries), are expanded to their common
leading dims and viewed as the op's batch (flattened to single heads unless there are two), the mask is shaped to
match, and the results are shaped back.
"""

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _module_checks


def _shapes(query: Tensor, key: Tensor, value: Tensor) -> str:
    return ("query " + _module_checks.shape(query) + ", key " + _module_checks.shape(key) + ", value "
            + _module_checks.shape(value))


def _broadcast(a: List[int], b: List[int]) -> Optional[List[int]]:
    """The leading dims that ``a`` and ``b`` broadcast to (aligned from the right, as matmul's), or None."""
    try:
        return list(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def check_any_rank(query: Tensor, key: Tensor, value: Tensor,
                   mask: Optional[Tensor]) -> Tuple[List[int], List[int]]:
    """Shape checks in the caller's own shapes: at least 2 dims each, leading dims that broadcast as the textbook's
    matmuls broadcast them, the query's d_k for the key, one length for key and value; the mask broadcast to the
    scores (..., Lq, Lk) without growing them. Returns the leading dims of the weights (query's and key's
    broadcast) and of the output (those and the value's)."""
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise RuntimeError("fastmha: query, key and value must have at least 2 dims (..., L, d), got "
                           + _shapes(query, key, value))
    if key.shape[-1] != query.shape[-1] or query.shape[-1] == 0:
        raise RuntimeError("fastmha: key must have the query's head size d_k (last dim, positive), got "
                           + _shapes(query, key, value))
    if value.shape[-2] != key.shape[-2]:
        raise RuntimeError("fastmha: key and value must have the same length (dim -2), got "
                           + _shapes(query, key, value))
    weights_lead = _broadcast(list(query.shape[:-2]), list(key.shape[:-2]))
    output_lead = None if weights_lead is None else _broadcast(weights_lead, list(value.shape[:-2]))
    if weights_lead is None or output_lead is None:
        raise RuntimeError("fastmha: the leading dims (all but the last two) of query, key and value must "
                           "broadcast, got " + _shapes(query, key, value))
    _module_checks.check_mask(mask, query.device, weights_lead + [query.shape[-2], key.shape[-2]])
    return weights_lead, output_lead


def to_heads(query: Tensor, key: Tensor, value: Tensor,
             mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], List[int], bool]:
    """(query, key, value, mask) as the op's (batch, h, L, d) tensors and a mask that broadcasts to their scores,
    the leading dims to restore, and whether the value's leading dims are wider than the weights' (then the value
    given to the op is a stand-in of zeros: the caller multiplies the weights by the value itself, as the textbook
    does). Views where the layout allows (always for rank 2 and 3 inputs of one batch)."""
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _module_checks.check_dense(t, name)  # before sizes and a reshape, which sparse and nested tensors lack
    lead, output_lead = check_any_rank(query, key, value, mask)
    wider_value = output_lead != lead
    if wider_value:
        value = value.new_zeros(()).expand(lead + [value.shape[-2], value.shape[-1]])
    heads = [t.expand(lead + [t.shape[-2], t.shape[-1]]) for t in (query, key, value)]
    if len(lead) == 2:  # the op's own layout: expanded views, no copy
        return heads[0], heads[1], heads[2], mask, lead, wider_value
    batch = math.prod(lead)
    heads = [t.reshape(batch, 1, t.shape[-2], t.shape[-1]) for t in heads]
    if mask is not None and mask.dim() > 2:
        # The mask's leading dims line up with `lead` from the right and must be flattened like the inputs'. For
        # one leading dim that is a view; for more, where a leading dim of the mask is not 1, a copy (expanded to
        # `lead`).
        rows, cols = mask.shape[-2], mask.shape[-1]
        if mask.dim() == 3 and len(lead) == 1:
            mask = mask.unsqueeze(1)
        elif all(size == 1 for size in mask.shape[:-2]):
            mask = mask.reshape(1, 1, rows, cols)
        else:
            mask = mask.expand(lead + [rows, cols]).reshape(batch, 1, rows, cols)
    return heads[0], heads[1], heads[2], mask, lead, wider_value


def from_heads(t: Tensor, lead: List[int]) -> Tensor:
    """One of the op's (batch, h, Lq, n) results, output or weights, in the caller's leading dims."""
    return t.reshape(lead + [t.shape[-2], t.shape[-1]])


def reshapes(query: object, key: object, value: object) -> bool:
    """Whether the static method shapes its inputs for the op: tensors that are not all (batch, h, L, d) of the
    same leading dims. Anything else goes to the op as given, for it to check and name."""
    if not (isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)):
        return False
    if query.is_nested or key.is_nested or value.is_nested:
        return query.dim() != 4  # no sizes to compare: the op, or to_heads's dense check, names it
    return not (query.dim() == 4 and key.dim() == 4 and value.dim() == 4
                and query.shape[:2] == key.shape[:2] and key.shape[:2] == value.shape[:2])
