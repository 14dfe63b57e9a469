"""The package itself: loading once, build information, the CMake package location, a missing library."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_build_info_file_names_the_torch_it_was_built_for():
    info = json.loads((Path(fastmha.__file__).with_name("_build_info.json")).read_text())
    assert info["version"] == fastmha.__version__
    assert info["torch"] == torch.__version__ and info["torch_cuda"] == torch.version.cuda
    assert info["cuda_kernels"] == fastmha.build_info["cuda_kernels"]


def test_mismatched_torch_is_refused_before_loading():
    from fastmha._loader import check_build_info

    built = {"version": "0.1.0", "torch": "2.15.0+cu132", "torch_cuda": "13.2", "cuda_kernels": True}
    check_build_info(built, "2.15.1+cu132", "13.2")  # a patch release keeps the ABI
    cases = [("2.14.0+cu132", "13.2", "built for torch 2.15.0\\+cu132 \\(CUDA 13.2\\), you have torch 2.14.0"),
             ("2.15.0+cpu", None, "with CUDA kernels .* you have torch 2.15.0\\+cpu \\(no CUDA\\)"),
             ("2.15.0+cu128", "12.8", "you have torch 2.15.0\\+cu128 \\(CUDA 12.8\\)")]
    for version, cuda, message in cases:
        with pytest.raises(ImportError, match=message + ".*pip install --no-build-isolation"):
            check_build_info(built, version, cuda)


def test_info_command_reports_machine_and_smoke_tests():
    result = subprocess.run([sys.executable, "-m", "fastmha.info"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"torch {torch.__version__}" in out and "library:" in out
    assert "cpu isa:" in out and f"fastmha {fastmha._C.cpu_capability()}" in out
    assert "smoke test cpu: ok" in out
    cpu_only = subprocess.run([sys.executable, "-m", "fastmha.info", "--cpu"], capture_output=True, text=True)
    assert cpu_only.returncode == 0 and cpu_only.stdout.startswith("cpu: ")


def test_info_lists_every_run_time_switch_the_sources_read():
    # A switch missing from the info command's list would be left out of bug reports.
    from fastmha.info import ENVIRONMENT_SWITCHES
    sources = Path(__file__).resolve().parents[2] / "csrc"
    read = set()
    for path in sources.rglob("*"):
        if path.suffix in (".cpp", ".h", ".cu", ".cuh"):
            read.update(re.findall(r'"(FASTMHA_[A-Z0-9_]+)"', path.read_text()))  # every name as a string
    assert {"FASTMHA_CPU_KERNELS", "FASTMHA_CUDA_KERNELS"} <= read  # the scan finds what it looks for
    assert read <= set(ENVIRONMENT_SWITCHES), sorted(read - set(ENVIRONMENT_SWITCHES))
