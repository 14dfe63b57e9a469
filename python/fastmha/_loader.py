"""Loads fastmha's native library after checking that it was built for the torch it runs with.

The build writes what it was built for into ``_build_info.json`` next to this file; it is read before the
library loads, so a mismatch is one clear sentence instead of an undefined-symbol error from the loader.
"""

import importlib
import json
from pathlib import Path

import torch

REBUILD = (
    "install the fastmha build made for your torch, or build it from source against it: "
    "pip install --no-build-isolation --no-deps --force-reinstall <fastmha source tree or sdist>"
)


def _major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _cuda_major(version):
    return None if version is None else version.split(".")[0]


def check_build_info(built: dict, torch_version: str, torch_cuda) -> None:
    """Raises ImportError when a binary built as `built` says cannot run with this torch."""
    described = f"torch {built['torch']}" + (f" (CUDA {built['torch_cuda']})" if built.get("torch_cuda") else "")
    have = f"torch {torch_version}" + (f" (CUDA {torch_cuda})" if torch_cuda else " (no CUDA)")
    if _major_minor(built["torch"]) != _major_minor(torch_version):
        raise ImportError(f"fastmha {built['version']} was built for {described}, you have {have}: {REBUILD}")
    if built.get("cuda_kernels") and _cuda_major(built.get("torch_cuda")) != _cuda_major(torch_cuda):
        raise ImportError(
            f"fastmha {built['version']} was built with CUDA kernels for {described}, you have {have}: {REBUILD}"
        )


def load_library():
    info_file = Path(__file__).with_name("_build_info.json")
    if info_file.exists():
        check_build_info(json.loads(info_file.read_text()), torch.__version__, torch.version.cuda)
    try:
        native = importlib.import_module("fastmha._C")
    except ImportError as error:
        raise ImportError(
            f"fastmha: its native library (fastmha._C / libfastmha) could not be loaded: {error}. "
            f"If torch changed since fastmha was built: {REBUILD}"
        ) from error
    info = native.build_info()
    if _major_minor(info["torch_version"]) != _major_minor(torch.__version__):
        raise ImportError(
            f"fastmha: built against torch {info['torch_version']} but torch {torch.__version__} is installed: {REBUILD}"
        )
    if info["cuda_kernels"] and torch.version.cuda is not None:
        built_major = info["cuda_version"].split(".")[0]
        torch_major = torch.version.cuda.split(".")[0]
        if built_major != torch_major:
            raise ImportError(
                f"fastmha: CUDA kernels built with CUDA {info['cuda_version']} but torch uses CUDA "
                f"{torch.version.cuda}: rebuild fastmha with a CUDA {torch_major}.x toolkit"
            )
    return native
