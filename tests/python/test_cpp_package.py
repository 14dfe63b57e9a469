"""C++ users: outside CMake projects build against the installed package (find_package(fastmha)), load a
model saved from Python without calling a fastmha symbol, train in C++, and weights move both ways."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from readme_blocks import readme_block

import fastmha

ROOT = Path(__file__).resolve().parents[2]


def build_example(name, build_dir, source_dir=None):
    venv_cmake = Path(sys.executable).parent / "cmake"
    cmake = str(venv_cmake) if venv_cmake.exists() else "cmake"
    source_dir = source_dir or ROOT / "examples" / "cpp" / name
    configure = [cmake, "-S", str(source_dir), "-B", str(build_dir), "-G", "Ninja",
                 f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{fastmha.cmake_prefix_path}",
                 "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    for command in (configure, [cmake, "--build", str(build_dir)]):
        result = subprocess.run(command, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return build_dir / name


class Tensors(torch.nn.Module):
    def __init__(self, **tensors):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def test_program_linking_only_the_target_runs_a_python_scripted_model(tmp_path):
    # run_scripted never calls a fastmha function: the ops are found because the target forces the link.
    exe = build_example("run_scripted", tmp_path / "build")
    block = fastmha.MultiHeadAttentionBlock(16, 4, 0.0).eval()
    x, mask = torch.randn(2, 5, 16), torch.rand(2, 1, 1, 5) > 0.2

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.block(x, x, x, mask)

    torch.jit.script(Layer()).save(str(tmp_path / "model.pt"))
    torch.jit.script(Tensors(x=x, mask=mask, expected=block(x, x, x, mask).detach())).save(str(tmp_path / "data.pt"))
    result = subprocess.run([str(exe), str(tmp_path / "model.pt"), str(tmp_path / "data.pt")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    readelf = subprocess.run(["readelf", "-d", str(exe)], capture_output=True, text=True).stdout
    assert "libfastmha.so" in readelf
    # The program loads the cuBLAS that torch loads in Python, not another copy from the system's search path
    # (libfastmha's own dependencies are looked up before torch's in a C++ program).
    cublas = torch_cublas_in_this_process()
    if cublas is not None:
        traced = subprocess.run([str(exe), str(tmp_path / "model.pt"), str(tmp_path / "data.pt")], capture_output=True,
                                text=True, env={**os.environ, "LD_DEBUG": "libs"})
        loaded = {os.path.realpath(line.split("calling init:")[1].strip()) for line in traced.stderr.splitlines()
                  if "calling init:" in line and "/libcublas.so" in line}
        assert loaded == {cublas}, loaded


def torch_cublas_in_this_process():
    """The cuBLAS library file this Python process has loaded with torch (None for a CPU-only torch)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libcublas.so" in line}
    return os.path.realpath(paths.pop()) if len(paths) == 1 else None


def test_cpp_training_and_weights_back_to_python(tmp_path):
    exe = build_example("train", tmp_path / "build")
    result = subprocess.run([str(exe), str(tmp_path / "out"), "300"], capture_output=True, text=True)
    assert result.returncode == 0 and "(learned)" in result.stdout, result.stdout + result.stderr
    block = fastmha.MultiHeadAttentionBlock(32, 4, 0.0).eval()
    block.load_state_dict(fastmha.load_cpp_state_dict(tmp_path / "out" / "attention.pt"), strict=True)
    probe = fastmha.load_cpp_state_dict(tmp_path / "out" / "probe.pt")
    with torch.no_grad():
        torch.testing.assert_close(block(probe["input"], probe["input"], probe["input"], None), probe["output"])


def test_python_state_dict_round_trips_through_cpp(tmp_path):
    # Python's torch.save -> fastmha::load_state_dict -> fastmha::save_state_dict -> fastmha.load_cpp_state_dict.
    exe = build_example("train", tmp_path / "build")
    source = fastmha.MultiHeadAttentionBlock(32, 4, 0.0)
    torch.save(dict(source.state_dict()), tmp_path / "from_python.pt")
    result = subprocess.run([str(exe), str(tmp_path / "out"), "0", str(tmp_path / "from_python.pt")],
                            capture_output=True, text=True)
    assert "wrote" in result.stdout, result.stdout + result.stderr  # 0 steps: "did not learn" is expected
    back = fastmha.load_cpp_state_dict(tmp_path / "out" / "attention.pt")
    assert list(back) == list(source.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(back[name], tensor)


def test_ordered_dict_from_python_gets_a_clear_error_in_cpp(tmp_path):
    exe = build_example("train", tmp_path / "build")
    torch.save(fastmha.MultiHeadAttentionBlock(32, 4, 0.0).state_dict(), tmp_path / "ordered.pt")  # OrderedDict
    result = subprocess.run([str(exe), str(tmp_path / "out"), "0", str(tmp_path / "ordered.pt")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "holds a Python OrderedDict (what state_dict() returns)" in result.stderr
    assert "save a plain dict: torch.save(dict(block.state_dict()), path)" in result.stderr
    assert "INTERNAL ASSERT" not in result.stderr  # the unpickler's own text is left out


def test_aotinductor_package_runs_from_cpp(tmp_path):
    # torch.export -> AOTInductor package -> a C++ program (no Python) with the fastmha library linked.
    torch.manual_seed(0)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = fastmha.MultiHeadAttentionBlock(32, 4, 0.0, need_weights=False)

        def forward(self, x, mask):
            return self.attention(x, x, x, mask)

    model = Layer().eval()
    x, mask = torch.randn(2, 7, 32), torch.rand(2, 1, 1, 7) > 0.2
    package = torch._inductor.aoti_compile_and_package(torch.export.export(model, (x, mask)),
                                                       package_path=str(tmp_path / "layer.pt2"))
    with torch.no_grad():
        expected = model(x, mask)
    torch.jit.script(Tensors(x=x, mask=mask, expected=expected)).save(str(tmp_path / "data.pt"))
    exe = build_example("aoti_run", tmp_path / "build")
    result = subprocess.run([str(exe), package, str(tmp_path / "data.pt")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "max |C++ - Python|" in result.stdout


def test_readme_cpp_example_runs_on_the_readmes_scripted_encoder(tmp_path):
    # The README's C++ program, built with its CMake lines, loads the encoder.pt that its Python block saves.
    (tmp_path / "encoder.py").write_text(readme_block("python", 'save("encoder.pt")'))  # scripting reads its source
    saved = subprocess.run([sys.executable, "encoder.py"], cwd=tmp_path, capture_output=True, text=True)
    assert saved.returncode == 0 and (tmp_path / "encoder.pt").exists(), saved.stdout + saved.stderr
    source = tmp_path / "source"
    source.mkdir()
    (source / "main.cpp").write_text(readme_block("cpp", "int main()"))
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.22)\nproject(app LANGUAGES CXX)\nset(CMAKE_CXX_STANDARD 20)\n"
        + readme_block("cmake", "find_package(fastmha REQUIRED)").replace(
            "target_link_libraries(app", "add_executable(app main.cpp)\ntarget_link_libraries(app"))
    exe = build_example("app", tmp_path / "build", source)
    result = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # The state dict it saved loads into the Python block.
    fastmha.MultiHeadAttentionBlock(64, 4, 0.1).load_state_dict(fastmha.load_cpp_state_dict(tmp_path / "mha.pt"))
