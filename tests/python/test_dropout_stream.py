"""The CPU kernels' dropout draws, bit for bit, against the NumPy Philox of philox_reference.py, which is
checked here against the specification's published known answers."""

import numpy as np
import pytest
import torch
from philox_reference import expected_keep, philox4x32_10


def test_reference_matches_the_published_known_answers():
    counters = np.array([[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]],
                        dtype=np.uint64)
    keys = [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0xA4093822, 0x299F31D0)]
    expected = [[0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
                [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
                [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]]
    for counter, key, words in zip(counters, keys, expected):
        assert philox4x32_10(counter[None, :], key)[0].tolist() == words


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["no mask", "padding", "causal", "padding and causal"])
# Rows shorter than one Philox batch (64 words with AVX2, 128 with AVX-512), exactly one, and longer; a chunk's rows
# of all keys are drawn in one pass, a padded chunk's spans a row at a time.
@pytest.mark.parametrize("lk", [301, 128, 64, 40])
def test_cpu_kernel_draws_the_philox_stream(dtype, case, lk):
    torch.manual_seed(0)
    b, h, lq, p = 2, 3, 37, 0.4
    q, k, v = torch.randn(b, h, lq, 8, dtype=dtype), torch.randn(b, h, lk, 8, dtype=dtype), torch.randn(
        b, h, lk, 8, dtype=dtype)
    mask = None
    if "padding" in case:  # the kernel computes only each chunk's visible keys; the draws stay put
        mask = (torch.arange(lk)[None, :] < torch.tensor([29, lk * 2 // 3])[:, None])[:, None, None, :]
    _, weights, _, rng_state = torch.ops.fastmha._attention_forward(q, k, v, mask, p, True, "causal" in case)
    seed, offset = (int(x) % 2**64 for x in rng_state.tolist())
    keep = expected_keep(seed, offset, (b, h, lq, lk), p)
    visible = torch.ones(b, h, lq, lk, dtype=torch.bool)
    if mask is not None:
        visible &= mask
    if "causal" in case:
        visible &= torch.ones(lq, lk, dtype=torch.bool).tril()
    # A visible weight is never exactly 0 here, so weights != 0 are the kept ones; masked ones are 0 either way.
    assert torch.equal(weights != 0, keep & visible)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
# Offsets whose low bits are set (the counter takes offset // 4) and a seed with its high word set.
@pytest.mark.parametrize("seed, offset", [(7, 0), (2**63 + 2**40 + 9, 4 * 2**33 + 3)])
def test_dropout_multipliers_replay_the_philox_stream(dtype, seed, offset):
    # Lengths below, at and above one Philox batch (64 or 128 words), odd ones, and one that the threads split into
    # parts starting inside a block; each thread count splits it differently.
    p = 0.3
    scale = torch.tensor(1 / (1 - p), dtype=dtype)
    rng_state = torch.tensor([seed - 2**64 if seed >= 2**63 else seed, offset])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            for shape in ((1,), (3, 5), (128,), (129,), (2, 2, 7, 64), (1, 2, 97, 211)):
                got = torch.ops.fastmha._dropout_multipliers(list(shape), p, dtype, rng_state)
                keep = expected_keep(seed, offset, shape, p)
                assert got.dtype == dtype and got.shape == shape
                assert torch.equal(got, keep.to(dtype) * scale), (count, shape)
    finally:
        torch.set_num_threads(threads)
