"""The key and value projections of a block's last call, kept for reuse while the same tensors come back unchanged.

A decoder that re-runs over a growing prefix (greedy or beam decoding as most Transformer code writes it) passes
the same encoder output as key and value to every cross-attention block at every step. Their projections
``key @ w_k^T`` and ``value @ w_v^T`` are then the same each time, and at a short prefix they are most of the
decoder's work. The memo hands back the tensors computed the first time, bit for bit what a new computation gives.

A tensor counts as the same only if it is the same object (held through a weak reference, so the memo never
keeps an input alive) with the same version counter, data pointer, shape, strides, dtype and device, and the same
bits as when the projections were made. The bits are compared with a copy the memo keeps, because some writes
leave the version counter alone (through ``.data``, or into memory shared with NumPy or DLPack); reading them is
far cheaper than the projection. The projections and copies are freed as soon as a source tensor is.
"""

import weakref
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

_SAME_SIZE_INTEGER = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _fingerprint(t: Tensor) -> tuple:
    return (t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _bits(t: Tensor) -> Tensor:
    # Integers of the same size: equality of bits (NaN equals itself, -0.0 differs from 0.0). A negated view (whose
    # bits torch does not reinterpret) is compared by the values it reads.
    return t.detach().resolve_neg().view(_SAME_SIZE_INTEGER[t.element_size()])


def can_hold(t: Tensor) -> bool:
    """Whether the memo can tell a later change of ``t``: a plain CPU tensor with storage (no subclass, fake,
    functorch or functional wrapper) and a version counter (inference tensors have none)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return False
    if t.device.type != "cpu" or t.is_inference() or t.element_size() not in _SAME_SIZE_INTEGER:
        return False
    try:
        t.data_ptr()  # wrappers (torch.func transforms) have no storage
    except RuntimeError:
        return False
    return True


class _Source(NamedTuple):
    ref: "weakref.ref[Tensor]"
    fingerprint: tuple
    bits: Tensor


class _KeptMask(NamedTuple):
    shape: torch.Size
    values: Tensor  # the mask without its broadcast dims (stride 0), which repeat the same values


def _keep_mask(mask: Tensor) -> _KeptMask:
    # An expanded mask is kept at the size it has in memory, not at its expanded size.
    values = mask.detach()
    for dim, (size, stride) in enumerate(zip(values.shape, values.stride())):
        if stride == 0 and size > 1:
            values = values.narrow(dim, 0, 1)
    return _KeptMask(mask.shape, values.clone())


class _Entry(NamedTuple):
    sources: List[_Source]
    context: object
    mask: Optional[_KeptMask]
    projections: Tuple[Tensor, ...]


def _same_mask(mask: Optional[Tensor], kept: Optional[_KeptMask]) -> bool:
    if mask is None or kept is None:
        return mask is None and kept is None
    values = kept.values
    return (mask.shape == kept.shape and mask.dtype == values.dtype and mask.device == values.device
            and torch.equal(_bits(mask), _bits(values).expand(kept.shape)))


class ProjectionMemo:
    """Projections keyed by the identity, version and bits of the tensors they were computed from."""

    def __init__(self) -> None:
        # One attribute, replaced whole: a lookup never pairs one call's sources with another's projections.
        self._entry: Optional[_Entry] = None

    def lookup(self, sources: Sequence[Tensor], context: object = None,
               mask: Optional[Tensor] = None) -> Optional[Tuple[Tensor, ...]]:
        """The projections stored for exactly these tensors, unchanged since, under an equal ``context`` (what
        else decides the projections' bits: thread count, matmul precision) and a mask of equal values (which
        decides the keys that the block projects); None otherwise."""
        entry = self._entry
        if (entry is None or len(sources) != len(entry.sources) or entry.context != context
                or not _same_mask(mask, entry.mask)):
            return None
        for t, source in zip(sources, entry.sources):
            if source.ref() is not t or _fingerprint(t) != source.fingerprint:
                return None
        compared = set()  # key and value are often one tensor: its bits are compared once
        for t, source in zip(sources, entry.sources):
            if id(t) not in compared and not torch.equal(_bits(t), source.bits):
                return None
            compared.add(id(t))
        return entry.projections

    def store(self, sources: Sequence[Tensor], projections: Tuple[Tensor, ...], context: object = None,
              mask: Optional[Tensor] = None) -> None:
        copies: Dict[int, Tensor] = {}  # key and value are often one tensor: one copy
        for t in sources:
            if id(t) not in copies:
                copies[id(t)] = _bits(t).clone()
        # The callbacks hold the memo weakly: no reference cycle keeps the projections alive after the module.
        memo = weakref.ref(self)

        def forget(dead: "weakref.ref[Tensor]") -> None:
            owner = memo()
            if owner is not None:
                owner._forget(dead)

        self._entry = _Entry([_Source(weakref.ref(t, forget), _fingerprint(t), copies[id(t)]) for t in sources],
                             context, None if mask is None else _keep_mask(mask), projections)

    def clear(self) -> None:
        self._entry = None

    def _forget(self, dead: object) -> None:
        # A source tensor was freed: its projections can never be asked for again.
        entry = self._entry
        if entry is not None and any(source.ref is dead for source in entry.sources):
            self._entry = None

    # Modules are copied and pickled with their attributes; a memo travels empty (weak references cannot).
    def __deepcopy__(self, memo: dict) -> "ProjectionMemo":
        return ProjectionMemo()

    def __getstate__(self) -> dict:
        return {"empty": True}  # not falsy: pickle protocols 0 and 1 call __setstate__ only for a true state

    def __setstate__(self, state: dict) -> None:
        self.__init__()
