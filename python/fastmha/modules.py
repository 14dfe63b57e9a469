"""fastmha.MultiHeadAttentionBlock: a drop-in for the textbook MultiHeadAttentionBlock(d_model, h, dropout)."""

import math
import numbers
import os
import warnings
from typing import Callable, List, Optional, Tuple, TypeVar

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.nn.modules import module as module_hooks

from . import _any_rank, _module_checks
from ._projection_memo import ProjectionMemo, can_hold

_T = TypeVar("_T")
_HALF_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _projection(x: Tensor, weight: Tensor) -> Tensor:
    """x W^T as the block's op computes it, bit for bit: the op's own product (widened to float32 for a half type
    that the CPU does not multiply natively, on oneDNN where FASTMHA_CPU_FLOAT_GEMM puts float32 products there)."""
    # Detached: torch's matmul picks its product for a non-contiguous x by whether an operand requires grad, and the
    # op, below autograd, sees none that does; the bits must be the op's.
    return torch.ops.fastmha._projection(x.detach(), weight.detach())


def _split_heads(x: Tensor, h: int) -> Tensor:
    """(batch, L, d_model) -> (batch, h, L, d_model // h), a view."""
    return x.view(x.shape[0], x.shape[1], h, x.shape[2] // h).transpose(1, 2)


def _merge_heads(x: Tensor) -> Tensor:
    """(batch, h, L, d_k) -> (batch, L, h * d_k)."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])


def _has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` would run a hook: its own, or a global one."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or module_hooks._global_forward_hooks
                or module_hooks._global_forward_pre_hooks or module_hooks._global_backward_hooks
                or module_hooks._global_backward_pre_hooks)


# The classes' own forwards as imported: a forward patched onto the class or set on an instance later is called.
_CLASS_FORWARDS = {nn.Linear: nn.Linear.forward, nn.Dropout: nn.Dropout.forward, nn.Identity: nn.Identity.forward}


# Weights the op may read: plain ones, and torch's own stand-ins for them while torch.export traces.
_PLAIN_WEIGHT_TYPES = (Tensor, nn.Parameter, FakeTensor, FunctionalTensor)


def _runs_its_class_forward(module: nn.Module) -> bool:
    """Whether calling ``module`` runs just its class's forward: no hook (its own or a global one) and no other
    forward set on the instance or patched onto the class (as offloading and adapter tools do; when they undo it,
    the class's forward may stay bound on the instance)."""
    class_forward = _CLASS_FORWARDS.get(type(module))
    own = module.__dict__.get("forward")
    return (not _has_hooks(module) and type(module).forward is class_forward
            and (own is None or (getattr(own, "__func__", None) is class_forward
                                 and getattr(own, "__self__", None) is module)))


def _is_plain_linear(module: nn.Module, d_model: int) -> bool:
    """A bias-free ``nn.Linear`` with a plain (d_model, d_model) weight (not a tensor subclass) that runs its class's
    forward: the op may read its weight instead of calling it."""
    if type(module) is not nn.Linear or module.bias is not None:
        return False
    weight = module.weight
    return (type(weight) in _PLAIN_WEIGHT_TYPES and weight.shape == (d_model, d_model)
            and _runs_its_class_forward(module))


def _input_width(module: nn.Module) -> int:
    """The features a projection module takes, where its weight says: a Linear layer's (out_features, width)
    weight, which the product uses. -1 (not checked; the module's output is) for other modules (wrappers) and
    for weights that do not say: a lazy Linear before its first input, a weight held elsewhere until a hook
    gathers it (sharded training), a packed one."""
    if not isinstance(module, nn.Linear) or isinstance(module, nn.modules.lazy.LazyModuleMixin):
        return -1  # a lazy layer's weight is not read before its first input (torch.compile would keep that read)
    weight = module.weight
    if isinstance(weight, nn.parameter.UninitializedParameter) or not isinstance(weight, Tensor):
        return -1
    if weight.dim() != 2 or weight.shape[0] != module.out_features:
        return -1
    return int(weight.shape[1])


def _is_plain_dropout(module: nn.Module) -> bool:
    """An ``nn.Dropout``, or an ``nn.Identity`` (no dropout), that runs its class's forward: the op applies it."""
    return type(module) in (nn.Dropout, nn.Identity) and _runs_its_class_forward(module)


def _quiet_when_traced(decide: Callable[[], _T]) -> _T:
    """``decide()``. Under torch.jit.trace the sizes it reads (the weights', the inputs') are traced values, and the
    trace keeps the path taken, as it keeps the modules it recorded: the tracer's warnings about them are not
    shown."""
    if not torch.jit.is_tracing():
        return decide()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return decide()


def _needs_torch_ops() -> bool:
    """Whether the block must compute with torch's own ops: under a torch.func transform (grad, vjp, jvp, vmap,
    ...), which cannot see through the ops' C++ autograd, and in an ONNX export, which has no fastmha operators."""
    return torch._C._are_functorch_transforms_active() or torch.onnx.is_in_onnx_export()


def _plain_attention(
    queries: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], dropout: Optional[nn.Module],
    is_causal: bool,
) -> Tuple[Tensor, Tensor]:
    """The attention core in torch's own ops, from the same formulas as the op: -1e9 where ``mask == 0`` or
    ``is_causal`` hides a key, scores and softmax of half types in float32, the dropout module called on the
    weights."""
    accumulate = torch.float32 if queries.dtype in _HALF_NAMES else queries.dtype
    scores = torch.matmul(queries.to(accumulate), keys.to(accumulate).transpose(-2, -1)) / math.sqrt(queries.shape[-1])
    _module_checks.check_mask(mask, queries.device, list(scores.shape))
    if is_causal:
        hidden = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(hidden, -1e9)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    weights = torch.softmax(scores, dim=-1).to(queries.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return torch.matmul(weights, values), weights


def _positive_int(value: object, name: str) -> int:
    """``value`` as an int when it is a positive integer (a numpy one too, not a bool), else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"fastmha: {name} must be a positive int, got {value!r}")
    return int(value)


def _is_probability(p) -> bool:
    """Whether ``p`` is a number (a 0-d tensor too, as nn.Dropout takes) in [0, 1]: a string or None is not."""
    if isinstance(p, (str, bytes)):
        return False
    try:
        return 0.0 <= float(p) <= 1.0
    except (TypeError, ValueError, RuntimeError):
        return False


def _dropout_probability(p: float, training: bool) -> float:
    """The probability an nn.Dropout applies: p in training, 0 otherwise. p may have been set after construction:
    checked in either mode, as F.dropout does."""
    if not (p >= 0.0 and p <= 1.0):  # NaN fails both
        raise ValueError("fastmha: dropout probability has to be between 0 and 1, but got " + str(p))
    return p if training else 0.0


def _broadcasts_batch(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether some of three inputs of one rank have batch 1 against a larger batch of the others, which the
    textbook block's matmuls broadcast (learned queries (1, Lq, d_model) over a batch of memories, say). Other
    batch mismatches are left to the checks."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return False  # for the op to name
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or q.is_nested or k.is_nested or v.is_nested:
        return False  # a nested tensor has no sizes to read: the checks name it
    bq, bk, bv = q.shape[0], k.shape[0], v.shape[0]
    if bq == bk and bk == bv:
        return False
    batch = max(bq, bk, bv)
    ones = int(bq == 1) + int(bk == 1) + int(bv == 1)
    fulls = int(bq == batch) + int(bk == batch) + int(bv == batch)
    return ones > 0 and ones + fulls == 3


def _repeats_one_entry(x: Tensor) -> bool:
    """Whether ``x`` (batch, L, d) repeats one entry along a batch of more than 1 without copies (an expanded
    memory: stride 0) and no gradient is asked of it (one asked of an input is per entry)."""
    return (x.layout == torch.strided and not x.is_nested and x.dim() == 3 and x.shape[0] > 1 and x.stride(0) == 0
            and not (x.requires_grad and torch.is_grad_enabled()))


def _first_if_repeated(x: Tensor) -> Tensor:
    """``x``'s first entry where it repeats one along its batch (``_repeats_one_entry``), else ``x``."""
    return x[:1] if _repeats_one_entry(x) else x


@torch.jit.unused
def _repeats_in_eager(x: object) -> bool:
    """``_repeats_one_entry`` for a tensor outside a recorded graph (torch.export, torch.jit.trace, ONNX export),
    which keeps no check of strides: a graph recorded on an expanded memory would project the first entry of any."""
    if torch.jit.is_tracing() or torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export():
        return False
    return isinstance(x, Tensor) and _repeats_one_entry(x)


def _expand_batch(q: Tensor, k: Tensor, v: Tensor, batch: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Projected heads (batch or 1, h, L, d_k) of batch 1 expanded (a view) to ``batch``."""
    expanded = [x.expand(batch, -1, -1, -1) if x.shape[0] != batch else x for x in (q, k, v)]
    return expanded[0], expanded[1], expanded[2]


def _mask_batch(mask: Optional[Tensor]) -> int:
    """The batch a mask gives the weights: its first dim when it has all four (batch, h, Lq, Lk), else 1 (also for
    what is not a tensor, which the op names). size(0), which a nested tensor answers too."""
    if isinstance(mask, Tensor) and mask.dim() == 4:
        return mask.size(0)
    return 1


def _matmul_precision() -> Tuple[str, ...]:
    """The fp32 matmul precision settings that may change the projections' bits. torch's legacy getter raises once
    the per-backend settings (torch.backends.fp32_precision, ...) have been used; those are read then."""
    try:
        return (torch.get_float32_matmul_precision(),)
    except RuntimeError:
        return (str(torch.backends.fp32_precision), str(torch.backends.mkldnn.matmul.fp32_precision))


class MultiHeadAttentionBlock(nn.Module):
    """Multi-head attention with the textbook block's constructor, attributes, parameters and numbers.

    Parameters (state_dict keys) are ``w_q.weight``, ``w_k.weight``, ``w_v.weight``, ``w_o.weight``: four
    bias-free ``nn.Linear(d_model, d_model)``. ``forward(q, k, v, mask)`` takes batch-first
    ``(batch, seq, d_model)`` tensors; where ``mask == 0`` (any dtype, broadcastable to
    ``(batch, h, Lq, Lk)``) the score is set to -1e9 before the softmax. After each forward,
    ``attention_scores`` holds the post-dropout weights ``(batch, h, Lq, Lk)`` (batch 1 where the query, key and
    mask all have batch 1), or None when ``need_weights`` is False (which also saves their memory). With
    ``is_causal=True`` query i attends keys j <= i only (top-left aligned when Lq != Lk), exactly as if
    ``tril(ones(Lq, Lk))`` were added to the mask, without materializing it (the kernels skip the masked key
    blocks).

    With gradients off, a block called again with the very same key and value tensors (a cross-attention in a
    decoder re-run over a growing prefix against one encoder output) reuses their projections from the
    previous call instead of recomputing them: the same numbers, bit for bit. Set ``reuse_projections=False``
    to always recompute.
    """

    attention_scores: Optional[Tensor]
    # A constant of the scripted code (decided in __prepare_scriptable__), so that TorchScript leaves out the fused
    # path, which reads the projections' weights, where the block calls its modules (which may have none).
    __constants__ = ["_calls_modules"]

    def __init__(
        self,
        d_model: int,
        h: int,
        dropout: float,
        need_weights: bool = True,
        is_causal: bool = False,
        reuse_projections: bool = True,
    ) -> None:
        """``d_model`` features split into ``h`` heads of ``d_k = d_model // h``; ``dropout`` is the probability
        of dropping an attention weight in training (an ``nn.Dropout``, so 1.0 drops them all). With
        ``need_weights=False`` the weights are not kept (``attention_scores`` stays None, and their memory is
        saved); with ``is_causal=True`` query i attends keys j <= i only; ``reuse_projections`` lets a call
        without gradients reuse the key and value projections of the previous call when its key and value are
        the same, unchanged tensors (see the class docstring). Raises ValueError for sizes that
        are not positive ints, ``d_model % h != 0``, or a dropout that is no number in [0, 1].
        """
        super().__init__()
        d_model, h = _positive_int(d_model, "d_model"), _positive_int(h, "h")
        if d_model % h != 0:
            raise ValueError(f"fastmha: d_model must be divisible by h, got d_model={d_model} and h={h}")
        if not _is_probability(dropout):
            raise ValueError(f"fastmha: dropout must be a number in [0, 1], got {dropout!r} ({type(dropout).__name__})")
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
        self.reuse_projections = reuse_projections
        self.attention_scores = None
        self._projection_memo = ProjectionMemo()
        self._calls_modules = False  # what a scripted block does: decided when it is scripted
        self._calls_dropout = False
        self._features = [d_model] * 4

    def __prepare_scriptable__(self) -> "MultiHeadAttentionBlock":
        # TorchScript cannot look at hooks or module types at run time: a block whose projections or dropout are
        # not plain when it is scripted calls them in the scripted code (which runs their scriptable hooks).
        self._calls_modules = not self._modules_are_plain()
        self._calls_dropout = not self._dropout_is_plain()
        self._features = self._input_features()
        return self

    def _dropout_p(self) -> float:
        """The probability the block's op applies as dropout: the nn.Dropout's (checked; 0 in eval), 0 for an
        nn.Identity or None in its place, or 0 where the block calls its dropout module on the weights instead
        (another module in its place, or a hook)."""
        if self._calls_dropout if torch.jit.is_scripting() else not self._dropout_is_plain():
            return 0.0
        if self.dropout is None:
            return 0.0
        if hasattr(self.dropout, "p"):  # decided when scripting: a module in its place may have no p
            return _dropout_probability(float(self.dropout.p), self.dropout.training)
        return 0.0

    @staticmethod
    def attention(
        query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], dropout: Optional[nn.Module]
    ) -> Tuple[Tensor, Tensor]:
        """The textbook static method: inputs (batch, h, seq, d_k); returns (weights @ value, weights).

        Inputs of any rank from 2 up, (..., seq, d_k) with leading dims that broadcast (keys and values shared by
        the heads, say), are taken as the textbook's matmuls take them. ``dropout`` is an ``nn.Dropout`` (applied
        only while it is in training mode), None, or another module, which is called on the weights as the
        textbook method does.
        """
        if _needs_torch_ops():
            return _plain_attention(query, key, value, mask, dropout, False)
        heads, lead, wider_value = (query, key, value, mask), None, False
        if _any_rank.reshapes(query, key, value):
            *heads, lead, wider_value = _any_rank.to_heads(query, key, value, mask)
        calls_dropout = dropout is not None and not _is_plain_dropout(dropout)
        p = 0.0
        if isinstance(dropout, nn.Dropout) and not calls_dropout:
            p = _dropout_probability(float(dropout.p), dropout.training)
        if calls_dropout or wider_value:
            # The weights from the op (dropped by it, or by the user's module in the caller's rank), times the value
            # as the caller gave it: a value with wider leading dims broadcasts the weights, as the textbook's does.
            _, weights = torch.ops.fastmha.attention(*heads, p if p < 1.0 else 0.0, True)
            weights = weights if lead is None else _any_rank.from_heads(weights, lead)
            if calls_dropout and dropout is not None:
                weights = dropout(weights)
            elif p >= 1.0:
                weights = weights * 0.0
            return torch.matmul(weights, value), weights
        output, weights = torch.ops.fastmha.attention(*heads, p if p < 1.0 else 0.0, True)
        if p >= 1.0:  # nn.Dropout(1.0) drops every weight
            output, weights = output * 0.0, weights * 0.0
        if lead is not None:
            output, weights = _any_rank.from_heads(output, lead), _any_rank.from_heads(weights, lead)
        return output, weights

    def forward(self, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor],
                mask: Optional[Tensor] = None) -> Tensor:
        """Attention of queries ``q`` (batch, Lq, d_model) over keys ``k`` and values ``v`` (batch, Lk, d_model).

        Where ``mask == 0`` (any dtype, broadcastable to (batch, h, Lq, Lk), e.g. a (batch, 1, 1, Lk) padding
        mask) the score is -1e9 before the softmax. Returns (batch, Lq, d_model) and keeps the post-dropout
        weights (batch, h, Lq, Lk) in ``attention_scores`` when ``need_weights`` is True. An input of batch 1
        broadcasts against the others' batch; where the query, key and mask all have batch 1, so do the weights.
        """
        # Optional in the signature so that a scripted block sees None as None (not as an undefined tensor) and
        # names it.
        if q is None or k is None or v is None:
            raise RuntimeError("fastmha: " + ("query" if q is None else "key" if k is None else "value")
                               + " must be a tensor, got None")
        p = self._dropout_p()
        # An input of batch 1, or one expanded along its batch, takes the module path too, which projects its entry
        # once and broadcasts the projection.
        fused = not (_broadcasts_batch(q, k, v) or _repeats_one_entry(q) or _repeats_one_entry(k)
                     or _repeats_one_entry(v)) if torch.jit.is_scripting() else not self._takes_module_path(q, k, v)
        # Decided when scripting (a constant, and hasattr, for a subclass whose own __constants__ hide ours): a block
        # that calls its modules has no fused path in the scripted code, which could not compile it for a projection
        # without a weight tensor (a wrapper, a quantized Linear).
        if not (torch.jit.is_scripting() and self._calls_modules) and fused and hasattr(self.w_q, "weight") \
                and hasattr(self.w_k, "weight") and hasattr(self.w_v, "weight") and hasattr(self.w_o, "weight"):
            result: Optional[Tuple[Tensor, Tensor]] = None
            if not torch.jit.is_scripting():
                result = self._forward_reusing_projections(q, k, v, mask, p if p < 1.0 else 0.0)
            if result is None:
                result = torch.ops.fastmha.multi_head_attention(
                    q, k, v, self.w_q.weight, self.w_k.weight, self.w_v.weight, self.w_o.weight,
                    self.h, mask, p if p < 1.0 else 0.0, self.need_weights, self.is_causal,
                )
            output, weights = result
            if p >= 1.0:  # nn.Dropout(1.0) drops every weight: zero weights, zero output
                output, weights = output * 0.0, weights * 0.0
        else:
            features = self._features if torch.jit.is_scripting() else self._input_features()
            _module_checks.check_block_inputs(q, k, v, self.d_model, "query", features)
            _module_checks.check_w_o_features(features[3], self.d_model)
            output, weights = self._attend_through_modules(q, k, v, mask, p)  # drops the weights itself at p >= 1
        self.attention_scores = weights if self.need_weights else None
        return output

    @torch.jit.unused
    def _modules_are_plain(self) -> bool:
        """Whether the block's op may read the four projections' weights and the dropout's probability without
        calling them: plain (d_model, d_model) projections (``_is_plain_linear``) and dropout
        (``_dropout_is_plain``), outside torch.func transforms and ONNX exports. A hook (forward, backward, or
        global), another module in their place (a wrapper, a parametrized or biased Linear, one of another width, a
        dropout of the user's) or a patched forward makes ``forward`` call them instead, as the textbook block
        does."""
        return not _needs_torch_ops() and self._dropout_is_plain() and all(
            _is_plain_linear(linear, self.d_model) for linear in (self.w_q, self.w_k, self.w_v, self.w_o))

    @torch.jit.unused
    def _input_features(self) -> List[int]:
        """The features that query, key, value and the merged heads must have for w_q, w_k, w_v and w_o on the
        module path: a Linear layer's input width (its weight's, which the product uses; a replacement may map
        another width to d_model, as cross-attention over a wider encoder's output does in the textbook block),
        -1 (not checked) where the weight does not say (``_input_width``)."""
        return _quiet_when_traced(lambda: [_input_width(m) for m in (self.w_q, self.w_k, self.w_v, self.w_o)])

    @torch.jit.unused
    def _takes_module_path(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether ``forward`` calls the modules: they are not plain, or an input of batch 1 broadcasts, or one
        repeats an entry along its batch (projected once there)."""
        return _quiet_when_traced(lambda: not self._modules_are_plain() or _broadcasts_batch(q, k, v) or any(
            _repeats_in_eager(x) for x in (q, k, v)))

    @torch.jit.unused
    def _projected_entries(self, x: Tensor, projection: nn.Module) -> Tensor:
        """The entries of ``x`` that ``projection`` needs: the one that ``x`` repeats along its batch
        (``_repeats_one_entry``), when the projection is a Linear layer that just runs its class's forward (the
        rows are then projected once and broadcast, as for an input of batch 1); else ``x`` itself (a hook sees
        the caller's tensor)."""
        if _repeats_in_eager(x) and type(projection) is nn.Linear and _runs_its_class_forward(projection):
            return x[:1]
        return x

    @torch.jit.unused
    def _step_takes_module_path(self) -> bool:
        return _quiet_when_traced(lambda: not self._modules_are_plain())

    @torch.jit.unused
    def _takes_torch_ops(self) -> bool:
        return _needs_torch_ops()

    @torch.jit.unused
    def _dropout_is_plain(self) -> bool:
        """Whether the block's op may apply ``self.dropout`` itself: an ``nn.Dropout``, or an ``nn.Identity`` or None
        (no dropout) in its place, that no hook watches."""
        return self.dropout is None or _is_plain_dropout(self.dropout)

    def _attend_through_modules(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], p: float
    ) -> Tuple[Tensor, Tensor]:
        """``forward``'s result with the projections computed by calling the four modules (so their hooks run),
        around the same attention core as the block's op (which checks the mask and the projected heads). With
        ``p`` >= 1 every weight is dropped before ``w_o``, as in the textbook block (w_o's bias stays)."""
        batch = max(q.shape[0], k.shape[0], v.shape[0])
        # The textbook's weights have the batch of the query, key and mask alone (the caller's, before an entry
        # repeated along the batch is taken once, and the projections'): where that is 1, the value's batch
        # broadcasts them, dropout and all.
        query_and_key_of_one = q.shape[0] == 1 and k.shape[0] == 1
        if not torch.jit.is_scripting():
            q, k, v = self._projected_entries(q, self.w_q), self._projected_entries(k, self.w_k), \
                self._projected_entries(v, self.w_v)
        elif not self._calls_modules:  # plain Linear layers: an entry repeated along the batch is projected once
            q, k, v = _first_if_repeated(q), _first_if_repeated(k), _first_if_repeated(v)
        queries, keys, values = self._heads_of(self.w_q(q), "w_q(query)"), self._heads_of(self.w_k(k), "w_k(key)"), \
            self._heads_of(self.w_v(v), "w_v(value)")
        # A projection may widen the batch (a hook returning another output can): the textbook broadcasts it too.
        batch = max(batch, queries.shape[0], keys.shape[0], values.shape[0])
        if query_and_key_of_one and queries.shape[0] == 1 and keys.shape[0] == 1 and batch > 1 \
                and _mask_batch(mask) == 1:  # weights of batch 1 times the values of the whole batch
            _, attention_weights = self._attention_core(queries, keys, values[:1], mask, p, True, self.is_causal)
            heads_out = torch.matmul(attention_weights, values.expand(batch, -1, -1, -1))
        else:
            queries, keys, values = _expand_batch(queries, keys, values, batch)
            heads_out, attention_weights = self._attention_core(
                queries, keys, values, mask, p, self.need_weights, self.is_causal)
        return self.w_o(_merge_heads(heads_out)), attention_weights

    def _heads_of(self, projected: Tensor, name: str) -> Tensor:
        """A projection module's output (batch, L, d_model), checked, as h heads of d_k."""
        return _split_heads(_module_checks.check_projected(projected, name, self.d_model), self.h)

    def _attention_core(
        self, queries: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], p: float, need_weights: bool,
        is_causal: bool,
    ) -> Tuple[Tensor, Tensor]:
        """The attention core of the module paths: the op's, with dropout ``p`` (every weight dropped at p >= 1),
        or, where the block calls its dropout module, the op's weights through that module, times the values; under
        a torch.func transform or in an ONNX export, the same formulas in torch's ops."""
        if not torch.jit.is_scripting() and self._takes_torch_ops():
            return _plain_attention(queries, keys, values, mask, self.dropout, is_causal)
        if self._calls_dropout if torch.jit.is_scripting() else not self._dropout_is_plain():
            _, weights = torch.ops.fastmha.attention(queries, keys, values, mask, 0.0, True, is_causal)
            if self.dropout is not None:  # never None here; TorchScript compiles the call only for a module
                weights = self.dropout(weights)
            return torch.matmul(weights, values), weights
        heads_out, weights = torch.ops.fastmha.attention(
            queries, keys, values, mask, p if p < 1.0 else 0.0, need_weights, is_causal
        )
        if p >= 1.0:
            heads_out, weights = heads_out * 0.0, weights * 0.0
        return heads_out, weights

    def _step_through_modules(
        self, x: Tensor, key_cache: Optional[Tensor], value_cache: Optional[Tensor], mask: Optional[Tensor], p: float
    ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """``forward_step`` with the projections computed by calling the modules, as ``forward`` does for them."""
        # The modules in forward's order (q, k, v).
        queries = self._heads_of(self.w_q(x), "w_q(x)")
        keys = self._heads_of(self.w_k(x), "w_k(x)")
        values = self._heads_of(self.w_v(x), "w_v(x)")
        _module_checks.check_step_inputs(keys, key_cache, value_cache, mask)
        if key_cache is not None and value_cache is not None:
            keys, values = torch.cat([key_cache, keys], 2), torch.cat([value_cache, values], 2)
        else:
            keys, values = keys.contiguous(), values.contiguous()
        len_new, len_total = x.shape[1], keys.shape[2]
        # New position i (absolute len_total - len_new + i) sees keys up to itself.
        visible = torch.ones(len_new, len_total, dtype=torch.bool, device=x.device).tril(len_total - len_new)
        if mask is not None:
            visible = (mask != 0) & visible
        heads_out, _ = self._attention_core(queries, keys, values, visible, p, False, False)
        return self.w_o(_merge_heads(heads_out)), (keys, values)

    @torch.jit.unused
    def _forward_reusing_projections(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], p: float
    ) -> Optional[Tuple[Tensor, Tensor]]:
        """``forward``'s result computed with the memo of key and value projections, or None where the memo
        does not apply (then ``forward`` takes its usual path). The first call of a run takes the block's own
        op (its checks, its numbers) and keeps the projections it made; later calls with the same key, value
        and weights project only the query, and run the same attention core and output projection."""
        # Not reached under torch.func transforms (vmap over q alone would keep batched projections): forward
        # takes the module path there.
        # Forward-mode AD runs under no_grad too: dual tensors take the op, which carries their tangents.
        if (not self.reuse_projections or k is q or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or torch.jit.is_tracing()  # a trace would record the kept projections as constants
                or torch.autograd.forward_ad._current_level >= 0):
            return None
        w_q, w_k, w_v, w_o = self.w_q.weight, self.w_k.weight, self.w_v.weight, self.w_o.weight
        sources = (k, v, w_k, w_v)
        if not all(can_hold(t) for t in sources) or torch.is_autocast_enabled("cpu"):
            return None
        if mask is not None and (type(mask) is not Tensor or mask.device != k.device or mask.is_complex()):
            return None  # the block's op names what is wrong with a complex mask
        if not isinstance(q, Tensor) or q.is_nested or q.layout != torch.strided:
            return None  # the block's op names a nested or sparse query
        # Besides the sources, what decides the projections' bits; the mask and is_causal decide which keys are
        # projected (the block leaves out keys that no query sees, except with is_causal).
        settings = (torch.get_num_threads(), _matmul_precision(), torch.backends.mkldnn.enabled, self.is_causal,
                    os.environ.get("FASTMHA_CPU_FLOAT_GEMM"))
        projections = self._projection_memo.lookup(sources, settings, mask)
        if projections is None:
            output, attention_weights, _, key_proj, value_proj, _, _, _ = (
                torch.ops.fastmha._multi_head_attention_forward(
                    q, k, v, w_q, w_k, w_v, w_o, self.h, mask, p, self.need_weights, self.is_causal
                )
            )
            self._projection_memo.store(sources, (key_proj, value_proj), settings, mask)
            return output, attention_weights
        if not all(type(t) in (Tensor, nn.Parameter) and t.dtype == k.dtype and t.device == k.device
                   for t in (q, w_q, w_o)):
            return None  # the block's op names what is wrong
        if q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != self.d_model or w_q.shape != w_k.shape or (
                w_o.shape != w_k.shape):
            return None

        generator_state = torch.random.get_rng_state() if p > 0 and mask is not None else None
        heads_out, attention_weights, logsumexp, _ = torch.ops.fastmha._attention_forward(
            _split_heads(_projection(q, w_q), self.h), _split_heads(projections[0], self.h),
            _split_heads(projections[1], self.h), mask, p,
            self.need_weights, self.is_causal,
        )
        # Kept projections may leave out keys that no query sees: when these queries give such a key some
        # weight (a row scored at or below -1e9 everywhere), the block's op projects every key.
        if mask is not None and not torch.ops.fastmha._unseen_keys_weigh_zero(logsumexp, k.shape[1]):
            if generator_state is not None:  # the block's op draws the same dropout
                torch.random.set_rng_state(generator_state)
            return None
        return _projection(_merge_heads(heads_out).contiguous(), w_o), attention_weights

    @torch.jit.export
    def forward_step(
        self, x: Optional[Tensor], cache: Optional[Tuple[Tensor, Tensor]] = None, mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """Incremental decoding of a decoder's self-attention: ``x`` (batch, T_new, d_model) are new positions,
        ``cache`` the (key, value) tensors (batch, h, T_past, d_k) returned by the previous step (None at the
        start). Each new position attends the cached positions and the new ones up to itself, and where ``mask``
        (broadcastable to (batch, h, T_new, T_past + T_new)) is not 0. Returns (output, new cache). Stepping
        through a sequence gives the same outputs as ``forward`` with a causal mask, with O(T_new) projections
        per step (except for a position whose every visible key is masked: the full computation spreads it
        uniformly over all positions, future ones included, a step over the cached positions and the new ones
        of its call). ``attention_scores`` is left as it was.
        """
        if x is None:  # as in forward
            raise RuntimeError("fastmha: x must be a tensor, got None")
        key_cache: Optional[Tensor] = None
        value_cache: Optional[Tensor] = None
        if cache is not None:
            if not torch.jit.is_scripting():
                _module_checks.check_cache(cache)
            key_cache, value_cache = cache
        p = self._dropout_p()
        fused = torch.jit.is_scripting() or not self._step_takes_module_path()  # scripted: _calls_modules decides
        if not (torch.jit.is_scripting() and self._calls_modules) and fused and hasattr(self.w_q, "weight") \
                and hasattr(self.w_k, "weight") and hasattr(self.w_v, "weight") and hasattr(self.w_o, "weight"):
            output, keys, values = torch.ops.fastmha.multi_head_attention_step(
                x, self.w_q.weight, self.w_k.weight, self.w_v.weight, self.w_o.weight, self.h,
                key_cache, value_cache, mask, p if p < 1.0 else 0.0,
            )
            if p >= 1.0:  # nn.Dropout(1.0) drops every weight
                output = output * 0.0
            return output, (keys, values)
        widths = self._features if torch.jit.is_scripting() else self._input_features()
        _module_checks.check_block_inputs(x, x, x, self.d_model, "x", [-1, -1, -1])
        _module_checks.check_step_widths(x, widths, self.d_model)
        _module_checks.check_w_o_features(widths[3], self.d_model)
        return self._step_through_modules(x, key_cache, value_cache, mask, p)

    def __setstate__(self, state: dict) -> None:
        # Blocks pickled by earlier versions have neither attribute.
        super().__setstate__(state)
        self.__dict__.setdefault("reuse_projections", True)
        self.__dict__.setdefault("_projection_memo", ProjectionMemo())
        self.__dict__.setdefault("_calls_modules", False)
        self.__dict__.setdefault("_calls_dropout", False)
        self.__dict__.setdefault("_features", [self.d_model] * 4)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, h={self.h}, d_k={self.d_k}, need_weights={self.need_weights}, "
                f"is_causal={self.is_causal}, reuse_projections={self.reuse_projections}")
