"""Reading weights that C++ wrote with fastmha::save_state_dict (torch.save's format)."""

from typing import Dict

import torch
import torch.jit._pickle
from torch import Tensor


def load_cpp_state_dict(path) -> Dict[str, Tensor]:
    """Loads a state dict written by ``fastmha::save_state_dict`` in C++, with ``weights_only`` loading.

    C++'s pickler tags containers with ``torch.jit._pickle.restore_type_tag``, which torch.load's safe mode does
    not allow by default; it only restores type annotations, so it is allowed here and nothing else is. Raises
    ValueError when the file holds anything but a dict of str to Tensor.
    """
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        loaded = torch.load(path, weights_only=True)
    no_state_dict = f"fastmha: {str(path)!r} holds no state dict (a dict of str to Tensor), got "
    if not isinstance(loaded, dict):
        raise ValueError(no_state_dict + type(loaded).__name__)
    for key, value in loaded.items():
        if not (isinstance(key, str) and isinstance(value, Tensor)):
            raise ValueError(no_state_dict + f"a dict with entry {key!r}: {type(value).__name__}")
    return dict(loaded)
