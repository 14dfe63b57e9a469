import getpass
import os
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Each run compiles into a cache of its own. torch's compile caches key a compiled backward by the traced forward
# graph, which names fastmha's public op only: a build whose backward op changed would run graphs compiled for the
# previous one. Nor are they keyed by ATEN_CPU_CAPABILITY: vector code compiled under one capability fails to
# compile when a run under another reuses it.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _COMPILE_CACHE = tempfile.TemporaryDirectory(prefix=f"torchinductor_{getpass.getuser()}_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _COMPILE_CACHE.name

import fastmha  # noqa: F401  (loads the ops)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Absolute/relative tolerances against the float64 oracle, per input dtype.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=2e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


def assert_close(actual, expected, dtype, name=None):
    """actual against expected within dtype's tolerances, compared in float64; `name` prefixes the failure message."""
    msg = None if name is None else (lambda m: f"{name}: {m}")
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCES[dtype], msg=msg)


def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (empty off x86)."""
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        text = cpuinfo.read()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "flags:")
    return set(line.split(":", 1)[1].split())


def torch_on_tiles():
    """Whether torch's CPU kernels multiply each dtype on AMX tiles on this CPU (with torch's AVX512 kernels: below,
    ATEN_CPU_CAPABILITY lowered, they do not)."""
    flags = cpu_flags()
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    return {torch.bfloat16: avx512 and "amx_bf16" in flags, torch.float16: avx512 and "amx_fp16" in flags,
            torch.float32: False, torch.float64: False}


def assert_attention_close(got, want, dtype, need_weights):
    """(output, weights, input gradients) of a call against the oracle's; kept weights are exactly zero where the
    oracle's are (keys the kernels skipped are written as zeros, as the math gives)."""
    (out, weights, grads), (ref_out, ref_weights, ref_grads) = got, want
    assert_close(out, ref_out, dtype)
    if need_weights:
        assert_close(weights, ref_weights, dtype)
        assert (weights[ref_weights == 0] == 0).all()
    for g, w in zip(grads, ref_grads):
        assert_close(g, w, dtype)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class OpCounter(TorchDispatchMode):
    """Counts the fastmha ops a call runs (their names), to see which path the block took."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fastmha":
            self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
