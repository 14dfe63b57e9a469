"""The package itself: loading once, build information, the CMake package location, a missing library."""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import fastmha


def test_import_twice_and_ops_registered():
    again = importlib.import_module("fastmha")
    assert again is fastmha
    importlib.reload(fastmha)  # reloading must not register the namespace twice
    for name in ("attention", "multi_head_attention", "_attention_forward", "_attention_backward",
                 "_multi_head_attention_forward", "_multi_head_attention_backward"):
        assert hasattr(torch.ops.fastmha, name)


def test_version_and_build_info():
    version_file = Path(__file__).resolve().parents[2] / "VERSION"
    assert fastmha.__version__ == version_file.read_text().strip()
    info = fastmha.build_info
    assert info["torch_version"].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert isinstance(info["cuda_kernels"], bool)
    if info["cuda_kernels"]:
        assert info["cuda_version"] and info["cuda_archs"]


def test_cmake_prefix_path_holds_the_package():
    prefix = Path(fastmha.cmake_prefix_path)
    assert (prefix / "lib" / "cmake" / "fastmha" / "fastmhaConfig.cmake").is_file()
    assert (prefix / "include" / "fastmha" / "fastmha.h").is_file()


def test_clear_error_when_library_missing(tmp_path):
    # A copy of the Python sources without the compiled library must fail to import with guidance.
    package = tmp_path / "fastmha"
    package.mkdir()
    for source in Path(fastmha.__file__).parent.glob("*.py"):
        shutil.copy(source, package)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", "import fastmha"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "fastmha: its native library" in result.stderr and "pip install" in result.stderr
