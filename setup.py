"""Builds fastmha through the project's CMake (one build definition for C++ and Python users).

CMake builds libfastmha (the op library) and fastmha._C, then installs them, the headers and the CMake package
into the Python package directory, which is also what fastmha.cmake_prefix_path points at.
Environment: FASTMHA_BUILD_DIR (default build/), MAX_JOBS, TORCH_CUDA_ARCH_LIST, FASTMHA_WITH_CUDA=0|1,
FASTMHA_CMAKE_ARGS (extra arguments for the configure step).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch

        package_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("FASTMHA_BUILD_DIR", ROOT / "build")).resolve()
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DFASTMHA_BUILD_PYTHON=ON",
            # Installed into the package: find libfastmha next to itself, torch through the loaded process.
            "-DCMAKE_INSTALL_RPATH=$ORIGIN",
        ]
        if "FASTMHA_WITH_CUDA" in os.environ:
            configure.append(f"-DFASTMHA_WITH_CUDA={'ON' if os.environ['FASTMHA_WITH_CUDA'] == '1' else 'OFF'}")
        if "TORCH_CUDA_ARCH_LIST" in os.environ:
            configure.append(f"-DTORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
        configure += shlex.split(os.environ.get("FASTMHA_CMAKE_ARGS", ""))
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)
        targets = {package_dir}
        if getattr(self, "editable_mode", False) or self.inplace:
            # Editable installs import from the source tree: put the library, headers and CMake package there.
            targets.add(ROOT / "python" / "fastmha")
        for prefix in targets:
            subprocess.run(["cmake", "--install", str(build_dir), "--prefix", str(prefix)], check=True)


setup(
    package_dir={"": "python"},
    packages=["fastmha"],
    ext_modules=[CMakeExtension("fastmha._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
