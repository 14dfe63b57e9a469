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

from .modules import MultiHeadAttentionBlock  # noqa: E402
from .ops import attention, explain, multi_head_attention  # noqa: E402
from .serialization import load_cpp_state_dict  # noqa: E402

__all__ = [
    "MultiHeadAttentionBlock",
    "attention",
    "explain",
    "multi_head_attention",
    "load_cpp_state_dict",
    "build_info",
    "cmake_prefix_path",
    "__version__",
]
