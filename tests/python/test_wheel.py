"""Packaging as a user meets it: the sdist builds a wheel, the wheel installs into a fresh environment that has
only torch, and works there with its build tree deleted: Python (forward, backward, the version check,
python -m fastmha.info) and an outside CMake project built against the installed package.

The wheel is built CPU-only (FASTMHA_WITH_CUDA=0) to keep the test command short; the CUDA build is the one
the rest of the suite uses. The fresh environment sees the test environment's torch through a path entry
(not its other packages' start-up hooks), so no second torch is downloaded.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.environ.get("FASTMHA_SKIP_WHEEL_TEST") == "1",
                                reason="FASTMHA_SKIP_WHEEL_TEST=1")


def run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of the fresh environment, the wheel file), the build tree already deleted."""
    work = tmp_path_factory.mktemp("wheel")
    # From the temporary folder: in the repository, `python -m build` would find the CMake build/ folder.
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(work / "dist"), str(ROOT)],
        cwd=work)
    (sdist,) = (work / "dist").glob("fastmha-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    for needed in ("CMakeLists.txt", "VERSION", "LICENSE", "cmake/fastmhaConfig.cmake.in",
                   "csrc/ops/attention.cpp", "csrc/include/fastmha/fastmha.h", "python/fastmha/py.typed"):
        assert any(name.endswith("/" + needed) for name in names), f"the sdist lacks {needed}"

    build_dir = work / "build"
    env = dict(os.environ, FASTMHA_WITH_CUDA="0", FASTMHA_BUILD_DIR=str(build_dir), MAX_JOBS="2")
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(work / "wheels"),
         str(sdist)], env=env, cwd=work)
    (wheel,) = (work / "wheels").glob("fastmha-*.whl")
    shutil.rmtree(build_dir)

    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=work)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    torch_site = Path(torch.__file__).resolve().parents[1]
    (site / "test_torch_path.pth").write_text(str(torch_site) + "\n")  # after the venv's own site-packages
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])
    return python, wheel, work


def test_wheel_names_its_torch_and_holds_one_library(installed):
    _, wheel, _ = installed
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert f"+torch{major}.{minor}." in wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert f"Requires-Dist: torch=={major}.{minor}.*" in metadata
    assert "License-Expression: BSD-3-Clause" in metadata
    libraries = [n for n in names if "/lib/libfastmha" in n]
    assert len(libraries) == 1, libraries  # no copies for symlinks a wheel cannot hold
    assert "fastmha/py.typed" in names
    assert not any("fastmha_tests" in n for n in names)


def test_installed_package_runs_from_python(installed):
    python, _, work = installed
    script = (
        "import torch, fastmha\n"
        "assert 'site-packages' in fastmha.__file__, fastmha.__file__\n"
        "q, k, v = (torch.randn(2, 3, 7, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))\n"
        "mask = torch.ones(2, 1, 1, 7, dtype=torch.bool); mask[0, ..., 5:] = False\n"
        "out, w = fastmha.attention(q, k, v, mask)\n"
        "ref = torch.softmax((q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, -1e9), -1) @ v\n"
        "assert torch.allclose(out, ref)\n"
        "out.sum().backward()\n"
        "assert torch.autograd.gradcheck(lambda q: fastmha.attention(q, k, v, mask)[0], (q,))\n"
        "print('ok')\n"
    )
    assert run([str(python), "-c", script], cwd=work).strip() == "ok"
    info = run([str(python), "-m", "fastmha.info"], cwd=work)
    assert "smoke test cpu: ok" in info and "site-packages" in info


def test_installed_package_refuses_another_torch_before_loading(installed):
    python, _, work = installed
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    info_file = site / "fastmha" / "_build_info.json"
    original = info_file.read_text()
    built = json.loads(original)
    try:
        info_file.write_text(json.dumps(dict(built, torch="2.9.0+cu126", torch_cuda="12.6")))
        result = subprocess.run([str(python), "-c", "import fastmha"], capture_output=True, text=True, cwd=work)
        assert result.returncode != 0
        assert "was built for torch 2.9.0+cu126 (CUDA 12.6), you have torch" in result.stderr
    finally:
        info_file.write_text(original)


def test_outside_cmake_project_builds_against_the_installed_package(installed):
    python, _, work = installed
    prefix = run([str(python), "-c", "import fastmha; print(fastmha.cmake_prefix_path)"]).strip()
    targets = (Path(prefix) / "lib" / "cmake" / "fastmha" / "fastmhaTargets.cmake").read_text()
    assert "/torch/lib/" not in targets and ".venv" not in targets, "build-machine paths in the CMake package"
    cmake = str(Path(sys.executable).parent / "cmake")
    build = work / "outside"
    run([cmake, "-S", str(ROOT / "examples" / "cpp" / "run_scripted"), "-B", str(build), "-G", "Ninja",
         "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{prefix}"])
    run([cmake, "--build", str(build)])
    model_dir = work / "model"  # the model the C++ tests load too, scripted in the fresh environment
    run([str(python), str(ROOT / "tests" / "cpp" / "export_scripted_model.py"), str(model_dir)], cwd=work)
    run([str(build / "run_scripted"), str(model_dir / "model.pt"), str(model_dir / "data.pt")])
