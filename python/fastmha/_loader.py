"""Loads fastmha's native library and checks that it matches the torch it runs with."""

import importlib

import torch


def _major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def load_library():
    try:
        native = importlib.import_module("fastmha._C")
    except ImportError as error:
        raise ImportError(
            "fastmha: its native library (fastmha._C / libfastmha) could not be loaded: "
            f"{error}. Build it with `pip install --no-build-isolation -e .` in the fastmha checkout "
            "(or run scripts/setup.sh)."
        ) from error
    info = native.build_info()
    if _major_minor(info["torch_version"]) != _major_minor(torch.__version__):
        raise ImportError(
            f"fastmha: built against torch {info['torch_version']} but torch {torch.__version__} is installed; "
            "rebuild fastmha (pip install --no-build-isolation -e .)"
        )
    if info["cuda_kernels"] and torch.version.cuda is not None:
        built_major = info["cuda_version"].split(".")[0]
        torch_major = torch.version.cuda.split(".")[0]
        if built_major != torch_major:
            raise ImportError(
                f"fastmha: CUDA kernels built with CUDA {info['cuda_version']} but torch uses CUDA "
                f"{torch.version.cuda}; rebuild fastmha with a CUDA {torch_major}.x toolkit"
            )
    return native
