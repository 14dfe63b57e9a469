"""fastmha: a fused, drop-in multi-head attention block for PyTorch.

Importing the package loads the native op library once; after that the ops are available as
``torch.ops.fastmha.*`` (also from TorchScript and torch.compile).
"""

import os

import torch

from ._loader import load_library as _load_library

_C = _load_library()

build_info = _C.build_info()
__version__: str = build_info["version"]

#: Prefix for CMake's find_package(fastmha): pass it in CMAKE_PREFIX_PATH (next to torch.utils.cmake_prefix_path).
cmake_prefix_path: str = os.path.dirname(os.path.abspath(__file__))

from . import _vmap_rules  # noqa: E402
from .modules import MultiHeadAttentionBlock  # noqa: E402
from .ops import attention, explain, multi_head_attention  # noqa: E402
from .serialization import load_cpp_state_dict  # noqa: E402

_vmap_rules.register()


def release_cpu_buffers() -> None:
    """Frees the CPU buffers of 4 MiB and more (kept attention weights, the backward's partial gradients) that
    fastmha keeps after their tensors are freed, so that a later call of about the same size finds its memory
    already mapped instead of paying the OS for fresh zeroed pages. Up to 16 are kept, 1 GiB in all; tensors in use
    are not touched. ``FASTMHA_CPU_REUSE_BUFFERS=0`` (set before the first call) keeps none."""
    _C.release_cpu_buffers()


def cached_cpu_buffer_bytes() -> int:
    """Bytes held in CPU buffers kept for reuse that no tensor uses (see :func:`release_cpu_buffers`)."""
    return _C.cached_cpu_buffer_bytes()

__all__ = [
    "MultiHeadAttentionBlock",
    "attention",
    "explain",
    "multi_head_attention",
    "load_cpp_state_dict",
    "release_cpu_buffers",
    "cached_cpu_buffer_bytes",
    "build_info",
    "cmake_prefix_path",
    "__version__",
]
