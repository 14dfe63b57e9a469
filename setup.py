"""Builds fastmha through the project's CMake (one build definition for C++ and Python users).

CMake builds libfastmha (the op library) and fastmha._C, then installs them, the headers and the CMake package
into the Python package directory, which is also what fastmha.cmake_prefix_path points at.
Environment: FASTMHA_BUILD_DIR (default build/), MAX_JOBS, TORCH_CUDA_ARCH_LIST (default 8.0;9.0+PTX),
FASTMHA_WITH_CUDA=0|1 (default: 1 when torch has CUDA), FORCE_CUDA=1, CUDA_HOME, FASTMHA_CMAKE_ARGS (extra
arguments for the configure step).
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# SASS for A100 (which sm_86/89 GPUs also run) and H100/H200, and PTX that newer GPUs compile when loading.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


MIN_CMAKE = (3, 28)  # torch >= 2.13 needs C++20, also for CUDA sources


def cmake_executable():
    """The CMake of this Python environment (PyPI's `cmake`), else the first on PATH; at least MIN_CMAKE."""
    try:
        import cmake

        candidate = os.path.join(cmake.CMAKE_BIN_DIR, "cmake")
    except ImportError:
        candidate = shutil.which("cmake")
    if candidate is None:
        sys.exit("fastmha: CMake >= %d.%d is needed to build: pip install 'cmake>=%d.%d'" % (MIN_CMAKE * 2))
    output = subprocess.run([candidate, "--version"], capture_output=True, text=True).stdout
    found = tuple(int(x) for x in re.search(r"(\d+)\.(\d+)", output).groups())
    if found < MIN_CMAKE:
        sys.exit(f"fastmha: {candidate} is CMake {found[0]}.{found[1]}; the build needs >= "
                 f"{MIN_CMAKE[0]}.{MIN_CMAKE[1]}: pip install 'cmake>={MIN_CMAKE[0]}.{MIN_CMAKE[1]}'")
    return candidate


def find_nvcc():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_compiler(torch):
    """The nvcc to build the CUDA kernels with, or None for a CPU-only build. CUDA kernels are built when torch
    has CUDA (or FORCE_CUDA=1), unless FASTMHA_WITH_CUDA=0."""
    if os.environ.get("FASTMHA_WITH_CUDA") == "0":
        return None
    wanted = torch.version.cuda is not None or os.environ.get("FORCE_CUDA") == "1" or \
        os.environ.get("FASTMHA_WITH_CUDA") == "1"
    if not wanted:
        return None
    nvcc = find_nvcc()
    if nvcc is None:
        sys.exit(f"fastmha: torch {torch.__version__} has CUDA {torch.version.cuda}, but no CUDA compiler (nvcc) was "
                 "found in CUDA_HOME, CUDA_PATH or /usr/local/cuda, or on PATH. Install the CUDA toolkit of that major "
                 "version, or build the CPU kernels only with FASTMHA_WITH_CUDA=0.")
    return nvcc


def torch_label(torch):
    """PEP 440 local label naming the torch the binary is built for: torch2.15.cu132, torch2.15.cpu."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    cuda = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    return f"torch{major}.{minor}.{cuda}"


def install_rpath(torch, cuda, editable_lib_dir):
    """libfastmha's run path: its own folder, then (CUDA builds) the folders of the cuBLAS and CUDA runtime that pip's
    torch loads, as seen from the library installed next to torch (site-packages/fastmha/lib) and, in an editable
    install, from the source tree. A C++ program may load libfastmha before torch's own libraries: without these
    entries its cuBLAS would come from the system's search path (a CUDA toolkit's copy, another release than the
    cuBLASLt torch loads). The loader skips folders that a machine does not have."""
    entries = ["$ORIGIN"]
    nvidia = Path(torch.__file__).resolve().parent.parent / "nvidia"
    for lib in sorted(nvidia.glob("*/lib")) if cuda else []:
        if any(lib.glob("libcublas.so*")) or any(lib.glob("libcudart.so*")):
            entries.append(f"$ORIGIN/../../nvidia/{lib.parent.name}/lib")
            if editable_lib_dir is not None:
                entries.append("$ORIGIN/" + os.path.relpath(lib, editable_lib_dir))
    return ";".join(entries)


def cmake_cache_value(build_dir, name):
    """A variable of the configured build (CMakeCache.txt), which FASTMHA_CMAKE_ARGS may have overridden."""
    for line in (Path(build_dir) / "CMakeCache.txt").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.split(":")[0] == name:
            return value
    return None


def write_build_info(torch, cuda, archs, directories):
    """What the binary was built for, read by fastmha/_loader.py before it loads the library."""
    info = {
        "version": (ROOT / "VERSION").read_text().strip(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_kernels": cuda,
        "cuda_archs": archs if cuda else None,
    }
    for directory in directories:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "_build_info.json").write_text(json.dumps(info, indent=1) + "\n")


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch

        package_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("FASTMHA_BUILD_DIR", ROOT / "build")).resolve()
        cmake = cmake_executable()
        nvcc = cuda_compiler(torch)
        cuda = nvcc is not None
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        editable = getattr(self, "editable_mode", False) or self.inplace
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            # Explicit, so a build tree configured from another environment takes this one's torch and archs
            # instead of keeping what its CMake cache holds.
            f"-DTorch_DIR={Path(torch.utils.cmake_prefix_path) / 'Torch'}",
            f"-DTORCH_CUDA_ARCH_LIST={archs}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DFASTMHA_BUILD_PYTHON=ON",
            # Installed into the package: libfastmha next to itself, torch's cuBLAS and CUDA runtime (install_rpath).
            "-DCMAKE_INSTALL_RPATH=" + install_rpath(torch, cuda, ROOT / "python" / "fastmha" / "lib" if editable
                                                     else None),
        ]
        configure.append(f"-DFASTMHA_WITH_CUDA={'ON' if cuda else 'OFF'}")
        # The Catch2 tests belong to a development tree (editable install), not to a wheel.
        tests = os.environ.get("FASTMHA_BUILD_TESTS", "1" if editable else "0") == "1"
        configure.append(f"-DFASTMHA_BUILD_TESTS={'ON' if tests else 'OFF'}")
        if nvcc is not None:
            configure.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        configure += shlex.split(os.environ.get("FASTMHA_CMAKE_ARGS", ""))
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, check=True)
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)
        targets = {package_dir}
        if editable:
            # Editable installs import from the source tree: put the library, headers and CMake package there.
            targets.add(ROOT / "python" / "fastmha")
        for prefix in targets:
            subprocess.run([cmake, "--install", str(build_dir), "--prefix", str(prefix)], check=True)
        # What was built, not what was asked for: FASTMHA_CMAKE_ARGS can turn the CUDA kernels off.
        cuda = cmake_cache_value(build_dir, "FASTMHA_WITH_CUDA") in ("ON", "TRUE", "1")
        archs = cmake_cache_value(build_dir, "TORCH_CUDA_ARCH_LIST") or archs
        write_build_info(torch, cuda, archs, targets)


def metadata():
    """The version carries the torch it is built for, and the wheel requires that torch's major.minor: the
    binary uses torch's C++ ABI, which changes between minor versions."""
    version = (ROOT / "VERSION").read_text().strip()
    try:
        import torch
    except ImportError:  # metadata-only runs (an sdist) need no torch
        return {"version": version}
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return {"version": f"{version}+{torch_label(torch)}", "install_requires": [f"torch=={major}.{minor}.*"]}


setup(
    **metadata(),
    package_dir={"": "python"},
    package_data={"fastmha": ["py.typed"]},
    packages=["fastmha"],
    ext_modules=[CMakeExtension("fastmha._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
