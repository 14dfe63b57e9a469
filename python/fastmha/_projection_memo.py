"""The key and value projections of a block's last call, kept for reuse while the same tensors come back unchanged.

A decoder that re-runs over a growing prefix (greedy or beam decoding as most Transformer code writes it) passes
the same encoder output as key and value to every cross-attention block at every step. Their projections
``key @ w_k^T`` and ``value @ w_v^T`` are then the same each time, and at a short prefix they are most of the
decoder's work. The memo hands back the tensors computed the first time, bit for bit what a new computation gives.

A tensor counts as the same only if it is the same object (held through a weak reference, so the memo never
keeps an input alive) with the same version counter (bumped by every in-place change, optimizer steps and
``load_state_dict`` included), data pointer, shape, strides, dtype and device. The projections are freed as soon
as the key or value tensor is.
"""

import weakref
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor


def _fingerprint(t: Tensor) -> tuple:
    return (t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def can_hold(t: Tensor) -> bool:
    """Whether the memo can tell a later change of ``t``: a plain tensor (no subclass, fake or functional
    wrapper) with a version counter (inference tensors have none)."""
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and not t.is_inference()


class ProjectionMemo:
    """Projections keyed by the identity and version of the tensors they were computed from."""

    def __init__(self) -> None:
        # One attribute, replaced whole: a lookup never pairs one call's sources with another's projections.
        self._entry: Optional[Tuple[List[Tuple[Callable[[], Optional[Tensor]], tuple]], object, Tuple[Tensor, ...]]]
        self._entry = None

    def lookup(self, sources: Sequence[Tensor], context: object = None) -> Optional[Tuple[Tensor, ...]]:
        """The projections stored for exactly these tensors, unchanged since, under an equal ``context`` (the
        caller's stream: projections made on one CUDA stream are not handed to another unsynchronized); None
        otherwise."""
        entry = self._entry
        if entry is None or len(sources) != len(entry[0]) or entry[1] != context:
            return None
        for t, (ref, fingerprint) in zip(sources, entry[0]):
            if ref() is not t or _fingerprint(t) != fingerprint:
                return None
        return entry[2]

    def store(self, sources: Sequence[Tensor], projections: Tuple[Tensor, ...], context: object = None) -> None:
        self._entry = ([(weakref.ref(t, self._forget), _fingerprint(t)) for t in sources], context, projections)

    def clear(self) -> None:
        self._entry = None

    def _forget(self, dead: object) -> None:
        # A source tensor was freed: its projections can never be asked for again.
        entry = self._entry
        if entry is not None and any(ref is dead for ref, _ in entry[0]):
            self._entry = None

    # Modules are copied and pickled with their attributes; a memo travels empty (weak references cannot).
    def __deepcopy__(self, memo: dict) -> "ProjectionMemo":
        return ProjectionMemo()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
