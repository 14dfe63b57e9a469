import pytest
import torch

import fastmha  # noqa: F401  (loads the ops)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Absolute/relative tolerances against the float64 oracle, per input dtype.
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=2e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCES[dtype])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
