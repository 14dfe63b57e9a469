"""What fastmha runs with, for bug reports: ``python -m fastmha.info``.

Prints the versions (fastmha, torch with its local tag, CUDA, Python), the CUDA archs compiled in against the
GPUs present, the CPU model, its vector ISA and the CPU kernel variant picked, the environment switches, the
library file loaded, and the result of one small call of each available path. ``--cpu`` prints only the CPU
lines (the test command starts with them).
"""

import argparse
import os
import platform
import sys

import torch

import fastmha

# Switches that change what fastmha or torch picks at run time.
ENVIRONMENT_SWITCHES = (
    "FASTMHA_CPU_KERNELS",
    "FASTMHA_CUDA_KERNELS",
    "FASTMHA_CUDA_FLASH",
    "FASTMHA_CUDA_MASKED",
    "FASTMHA_CUDA_DROPOUT",
    "FASTMHA_LOG_KERNELS",
    "FASTMHA_CPU_KEY_BLOCK",
    "FASTMHA_CPU_REUSE_BUFFERS",
    "FASTMHA_CPU_HALF_GEMM",
    "FASTMHA_CPU_FLOAT_GEMM",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "OMP_NUM_THREADS",
    "TORCH_CUDA_ARCH_LIST",
)

# /proc/cpuinfo flag names of the vector extensions the kernels and the BLAS care about.
ISA_FLAGS = (
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("avx512f", "AVX-512F"),
    ("avx512_bf16", "AVX512-BF16"),
    ("avx512_fp16", "AVX512-FP16"),
    ("amx_tile", "AMX"),
    ("amx_bf16", "AMX-BF16"),
)


def cpu_model_and_flags():
    """The CPU's model name (with its family and model numbers, which tell CPU generations apart where a
    virtual machine shows a short name) and its /proc/cpuinfo flags (empty where the file does not exist)."""
    model, flags, numbers = platform.processor() or "unknown", set(), {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("unknown", "", platform.machine()):
                    model = value.strip()
                elif key in ("cpu family", "model") and key not in numbers:
                    numbers[key] = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if len(numbers) == 2:
        model += f" (family {numbers['cpu family']}, model {numbers['model']})"
    return model, flags


def cpu_lines():
    model, flags = cpu_model_and_flags()
    isa = [name for flag, name in ISA_FLAGS if flag in flags] or ["none of " + ", ".join(n for _, n in ISA_FLAGS)]
    return [
        f"cpu: {model} ({os.cpu_count()} logical cores, torch threads {torch.get_num_threads()})",
        f"cpu isa: {' '.join(isa)}",
        f"cpu kernels: fastmha {fastmha._C.cpu_capability()} | torch {torch.backends.cpu.get_cpu_capability()}",
    ]


def cuda_lines():
    info = fastmha.build_info
    lines = [
        f"cuda: torch {torch.version.cuda} | fastmha kernels "
        + (f"built with CUDA {info['cuda_version']} for {info['cuda_archs']}" if info["cuda_kernels"] else "not built")
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            lines.append(f"gpu {index}: {torch.cuda.get_device_name(index)} (sm_{major}{minor})")
    else:
        lines.append("gpu: none visible")
    return lines


def loaded_libraries():
    """The fastmha shared objects this process has loaded (the Python module and the op library)."""
    paths = {fastmha._C.__file__}
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths.update(line.split()[-1] for line in maps if "libfastmha" in line)
    except OSError:
        pass
    return sorted(paths)


def smoke_test(device):
    """One small forward and backward of the core op on `device`, against the formulas."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    expected = torch.softmax((q @ k.transpose(-2, -1) / 8**0.5).masked_fill(~mask, -1e9), -1) @ v
    inputs = [t.to(device).requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.fastmha.attention(*inputs, mask.to(device), 0.0, False, False)
    out.sum().backward()
    error = (out.detach().cpu() - expected).abs().max().item()
    return "ok" if error < 1e-10 else f"WRONG (max error {error:.3g})"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastmha.info", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="print only the CPU model, ISA and kernel variant")
    args = parser.parse_args(argv)
    if args.cpu:
        print("\n".join(cpu_lines()))
        return 0
    lines = [
        f"fastmha {fastmha.__version__} | torch {torch.__version__} (built against {fastmha.build_info['torch_version']})"
        f" | Python {platform.python_version()}",
        f"library: {', '.join(loaded_libraries())}",
        *cpu_lines(),
        *cuda_lines(),
        "environment: "
        + (", ".join(f"{name}={os.environ[name]}" for name in ENVIRONMENT_SWITCHES if name in os.environ) or "no switches set"),
    ]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and fastmha.build_info["cuda_kernels"] else [])
    for device in devices:
        try:
            lines.append(f"smoke test {device}: {smoke_test(device)}")
        except Exception as error:  # a report tool: show the failure instead of stopping at it
            lines.append(f"smoke test {device}: FAILED ({type(error).__name__}: {error})")
    print("\n".join(lines))
    return 0 if all("ok" in line for line in lines if line.startswith("smoke test")) else 1


if __name__ == "__main__":
    sys.exit(main())
