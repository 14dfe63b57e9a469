"""fastmha demo: the block inside a small Transformer layer, next to the same layer built on the oracle block
(plain PyTorch from the formulas); then the layer scripted, saved, and run from a C++ program.

    python examples/python/demo.py [--steps N] [--device cpu|cuda] [--out DIR]
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

import fastmha

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from oracle import OracleBlock  # noqa: E402


class OracleAttention(OracleBlock):
    """The oracle block with the drop-in's call signature, for use inside the same layer."""

    def forward(self, q, k, v, mask=None):  # type: ignore[override]
        return super().forward(q, k, v, mask)[0]


class EncoderLayer(nn.Module):
    def __init__(self, attention: nn.Module, d_model: int):
        super().__init__()
        self.attention = attention
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.ReLU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        x = self.norm1(x + self.attention(x, x, x, mask))
        return self.norm2(x + self.feed_forward(x))


class Tensors(nn.Module):
    """Tensors saved as a TorchScript archive, so a C++ program reads them with torch::jit::load."""

    def __init__(self, **tensors: Tensor):
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def make_batch(batch, length, d_model, device, generator):
    x = torch.randn(batch, length, d_model, generator=generator).to(device)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator).to(device)
    mask = (torch.arange(length, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    return x, mask, x.flip(1)  # toy task: reverse the sequence


def train(model, args, device):
    torch.manual_seed(1)
    generator = torch.Generator().manual_seed(2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, times = [], []
    for _ in range(args.steps):
        x, mask, target = make_batch(args.batch, args.length, args.d_model, device, generator)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = (model(x, mask) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, sorted(times)[len(times) // 2]


def run_cpp_example(out_dir: Path) -> bool:
    source = ROOT / "examples" / "cpp" / "run_scripted"
    build = out_dir / "run_scripted-build"
    prefix = f"{torch.utils.cmake_prefix_path};{fastmha.cmake_prefix_path}"
    venv_cmake = Path(sys.executable).parent / "cmake"  # the environment's CMake (C++20 + CUDA needs >= 3.28)
    cmake = str(venv_cmake) if venv_cmake.exists() else "cmake"
    configure = [cmake, "-S", str(source), "-B", str(build), "-G", "Ninja", f"-DCMAKE_PREFIX_PATH={prefix}",
                 "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    print(f"\n[C++] building examples/cpp/run_scripted against find_package(fastmha) in {build}")
    for command in (configure, [cmake, "--build", str(build)]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:])
            return False
    result = subprocess.run([str(build / "run_scripted"), str(out_dir / "model.pt"), str(out_dir / "data.pt")],
                            capture_output=True, text=True)
    print("[C++] " + (result.stdout + result.stderr).strip())
    return result.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--skip-cpp", action="store_true", help="do not build and run the C++ example")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"fastmha {fastmha.__version__} | torch {torch.__version__} | device {device} | "
          f"threads {torch.get_num_threads()} | build {fastmha.build_info}")

    torch.manual_seed(0)
    ours = EncoderLayer(fastmha.MultiHeadAttentionBlock(args.d_model, args.heads, 0.0), args.d_model).to(device)
    oracle = EncoderLayer(OracleAttention(args.d_model, args.heads), args.d_model).to(device)
    oracle.load_state_dict(ours.state_dict(), strict=True)  # same parameter names: weights move as they are

    generator = torch.Generator().manual_seed(0)
    x, mask, _ = make_batch(args.batch, args.length, args.d_model, device, generator)
    with torch.no_grad():
        diff = (ours(x, mask) - oracle(x, mask)).abs().max().item()
    print(f"\nforward, padding mask, (batch, L, d_model) = {tuple(x.shape)}: max |fastmha - oracle| = {diff:.2e}")

    print(f"training both layers for {args.steps} steps (same weights, same data, dropout 0)")
    ours_losses, ours_time = train(ours, args, device)
    oracle_losses, oracle_time = train(oracle, args, device)
    for step in sorted({0, args.steps // 2, args.steps - 1}):
        print(f"  step {step:4d}: loss fastmha {ours_losses[step]:.5f} | oracle {oracle_losses[step]:.5f}")
    curve_gap = max(abs(a - b) for a, b in zip(ours_losses, oracle_losses))
    print(f"  largest loss gap along the curve: {curve_gap:.2e}")
    print(f"  median step time: fastmha {ours_time * 1e3:.1f} ms | oracle {oracle_time * 1e3:.1f} ms | "
          f"speed-up {oracle_time / ours_time:.2f}x")

    ours.eval()
    warnings.filterwarnings("ignore", message=".*torch.jit.* is deprecated")  # TorchScript is what C++ loads
    scripted = torch.jit.script(ours)
    scripted.save(str(args.out / "model.pt"))
    with torch.no_grad():
        expected = ours(x, mask)
    torch.jit.script(Tensors(x=x.cpu(), mask=mask.cpu(), expected=expected.cpu())).save(str(args.out / "data.pt"))
    print(f"\nsaved the scripted layer to {args.out / 'model.pt'}")

    ok = diff < 1e-4 and curve_gap < 1e-3
    if not args.skip_cpp:
        ok = run_cpp_example(args.out) and ok
    print("\ndemo " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
