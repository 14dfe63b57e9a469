"""Input checks, with the ops' messages, for the block's path that calls its projection modules (hooks, biases,
wrappers): a module may accept what the block's op does not (a 4-D input, a cache of another dtype). Scriptable,
so that a scripted block checks the same."""

from typing import List, Optional

import torch
from torch import Tensor


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as the ops name it (TorchScript's str() of a dtype is a number)."""
    for candidate, name in ((torch.float32, "Float"), (torch.float64, "Double"), (torch.float16, "Half"),
                            (torch.bfloat16, "BFloat16"), (torch.int64, "Long"), (torch.int32, "Int"),
                            (torch.bool, "Bool"), (torch.complex64, "ComplexFloat")):
        if dtype == candidate:
            return name
    return str(dtype)


@torch.jit.ignore
def _type_name(x: object) -> str:
    return "None" if x is None else type(x).__name__


def shape(x: Tensor) -> str:
    sizes: List[int] = list(x.shape)
    return str(sizes)


def check_dense(x: Tensor, name: str) -> None:
    if x.layout != torch.strided or x.is_nested:
        raise RuntimeError("fastmha: " + name + " must be a dense (strided) tensor")


def check_block_inputs(q: Tensor, k: Tensor, v: Tensor, d_model: int, q_name: str = "query",
                       features: Optional[List[int]] = None) -> None:
    """q (batch, Lq, d_model), k and v (batch, Lk, d_model), floating point, of one dtype and device. Errors call q
    ``q_name`` (a decoding step's is its input x). ``features``: the last dims of q, k and v where the projections
    that take them are Linear layers of another input width (w_q.in_features, ...) rather than d_model."""
    given = [q, k, v]
    given_names = [q_name, "key", "value"]
    for i in range(3):
        if not isinstance(given[i], Tensor):  # the op names None; the module path calls the modules first
            raise RuntimeError("fastmha: " + given_names[i] + " must be a tensor, got " + _type_name(given[i]))
    if q.dtype != torch.float32 and q.dtype != torch.float64 and q.dtype != torch.float16 and q.dtype != torch.bfloat16:
        raise RuntimeError("fastmha: " + q_name + " must be a floating-point tensor (float32, float64, float16 or "
                           "bfloat16), got " + dtype_name(q.dtype))
    layouts = ["(batch, Lq, d_model)", "(batch, Lk, d_model)", "(batch, Lk, d_model)"]
    names = [q_name, "key", "value"]
    tensors = [q, k, v]
    for i in range(3):
        x, name = tensors[i], names[i]
        check_dense(x, name)
        if x.dtype != q.dtype:
            raise RuntimeError("fastmha: " + name + " must have the query's dtype " + dtype_name(q.dtype) + ", got "
                               + dtype_name(x.dtype))
        if x.device != q.device:
            raise RuntimeError("fastmha: " + name + " must be on the query's device " + str(q.device) + ", got "
                               + str(x.device))
        if x.dim() != 3:
            raise RuntimeError("fastmha: " + name + " must be 3-D " + layouts[i] + ", got shape " + shape(x))
        expected = d_model if features is None else features[i]  # -1: not checked
        if expected == d_model and x.shape[2] != d_model:
            raise RuntimeError("fastmha: " + name + " must have d_model = " + str(d_model)
                               + " features (last dim), got shape " + shape(x))
        if expected >= 0 and x.shape[2] != expected:
            raise RuntimeError("fastmha: " + name + " must have " + str(expected) + " features (last dim), the input "
                               "width of w_" + "qkv"[i] + ", got shape " + shape(x))
    # The module path broadcasts a batch of 1, as the textbook block's matmuls do.
    batch = max(q.shape[0], k.shape[0], v.shape[0])
    for x in tensors:
        if x.shape[0] != batch and x.shape[0] != 1:
            raise RuntimeError("fastmha: query, key and value must have the same batch size (dim 0), or 1, got query "
                               + shape(q) + ", key " + shape(k) + ", value " + shape(v))
    if k.shape[1] != v.shape[1]:
        raise RuntimeError("fastmha: key and value must have the same length (dim 1), got key " + shape(k)
                           + ", value " + shape(v))


@torch.jit.ignore
def check_cache(cache: object) -> None:
    """A decoding step's cache: None or the (key_cache, value_cache) pair a previous step returned (TorchScript's
    Tuple annotation checks a scripted call)."""
    if cache is None or (isinstance(cache, (tuple, list)) and len(cache) == 2):
        return
    if isinstance(cache, (tuple, list)):
        got = "a " + type(cache).__name__ + " of " + str(len(cache))
    elif isinstance(cache, Tensor):
        got = "a tensor of shape " + str(list(cache.shape))
    else:
        got = _type_name(cache)
    raise RuntimeError("fastmha: cache must be None or the (key_cache, value_cache) pair a previous step returned, "
                       "got " + got)


def check_step_widths(x: Tensor, widths: List[int], d_model: int) -> None:
    """A decoding step's x goes to w_q, w_k and w_v: it must have the features of each that says (``widths``, -1
    where the module does not say)."""
    for i in range(3):
        if widths[i] >= 0 and x.shape[2] != widths[i]:
            size = "d_model = " + str(d_model) if widths[i] == d_model else str(widths[i])
            where = "" if widths[i] == d_model else ", the input width of w_" + "qkv"[i]
            raise RuntimeError("fastmha: x must have " + size + " features (last dim)" + where + ", got shape "
                               + shape(x))


def check_projected(projected: Tensor, name: str, d_model: int) -> Tensor:
    """A projection module's output for the heads: (batch, L, d_model), as the textbook block's view into h heads
    of d_k needs. ``name`` says which module on which input, as in w_q(query)."""
    if projected.dim() != 3 or projected.shape[2] != d_model:
        raise RuntimeError("fastmha: " + name + " must give d_model = " + str(d_model)
                           + " features (last dim) to split into heads, got shape " + shape(projected))
    return projected


def check_w_o_features(width: int, d_model: int) -> None:
    """w_o takes the merged heads, d_model features: a Linear layer of another input width (``width``; -1 for a lazy
    one that takes any) cannot."""
    if width >= 0 and width != d_model:
        raise RuntimeError("fastmha: w_o must take the merged heads' d_model = " + str(d_model)
                           + " features, got a Linear layer of input width " + str(width))


def check_step_inputs(keys: Tensor, key_cache: Optional[Tensor], value_cache: Optional[Tensor],
                      mask: Optional[Tensor]) -> None:
    """A decoding step's caches against its projected keys (batch, h, T_new, d_k), and the caller's mask as given
    against the scores (batch, h, T_new, T_past + T_new)."""
    if (key_cache is None) != (value_cache is None):
        raise RuntimeError("fastmha: key_cache and value_cache must be given together")
    len_past = 0
    if key_cache is not None and value_cache is not None:
        caches = [key_cache, value_cache]
        names = ["key_cache", "value_cache"]
        for i in range(2):
            check_dense(caches[i], names[i])
            if caches[i].dtype != keys.dtype or caches[i].device != keys.device:
                raise RuntimeError("fastmha: " + names[i] + " must have the projected keys' dtype "
                                   + dtype_name(keys.dtype) + " and device " + str(keys.device) + ", got "
                                   + dtype_name(caches[i].dtype) + " on " + str(caches[i].device))
        if (key_cache.dim() != 4 or key_cache.shape[0] != keys.shape[0] or key_cache.shape[1] != keys.shape[1]
                or key_cache.shape[3] != keys.shape[3] or list(value_cache.shape) != list(key_cache.shape)):
            raise RuntimeError("fastmha: key_cache and value_cache must have shape (batch, heads, T_past, d_k) = ("
                               + str(keys.shape[0]) + ", " + str(keys.shape[1]) + ", T_past, " + str(keys.shape[3])
                               + "), got key_cache " + shape(key_cache) + " and value_cache " + shape(value_cache))
        len_past = key_cache.shape[2]
    check_mask(mask, keys.device, [keys.shape[0], keys.shape[1], keys.shape[2], len_past + keys.shape[2]], "x")


def check_mask(mask: Optional[Tensor], device: torch.device, scores: List[int], q_name: str = "query") -> None:
    """A mask for scores of shape ``scores`` ((batch, h, Lq, Lk), or fewer leading dims): real or bool, on
    ``device`` (the query's, named ``q_name``), broadcastable to them without growing them."""
    if mask is not None:
        check_dense(mask, "mask")
        if mask.is_complex():
            raise RuntimeError("fastmha: mask must be a real or bool tensor, got " + dtype_name(mask.dtype))
        if mask.device != device:
            raise RuntimeError("fastmha: mask must be on the " + q_name + "'s device " + str(device) + ", got "
                               + str(mask.device))
        fits = mask.dim() <= len(scores)
        for i in range(mask.dim()):
            if fits and mask.shape[i] != 1 and mask.shape[i] != scores[len(scores) - mask.dim() + i]:
                fits = False
        if not fits:
            layout = "(batch, h, Lq, Lk) " if len(scores) == 4 else "(..., Lq, Lk) "
            raise RuntimeError("fastmha: mask of shape " + shape(mask) + " does not broadcast to the scores " + layout
                               + str(scores))
