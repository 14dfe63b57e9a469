"""The CPU kernels' dropout draws, bit for bit: element e of the (B, H, Lq, Lk) score layout keeps its weight
iff the uniform of word e % 4 of Philox4x32-10 block e // 4 is >= p. The reference here is written from the
Philox specification (Salmon et al., SC 2011) in NumPy and checked against the published known answers."""

import numpy as np
import pytest
import torch

M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter_words, key):
    """Philox4x32-10 of counters (n, 4) uint32-valued words under key (k0, k1): returns (n, 4) words."""
    c0, c1, c2, c3 = (np.asarray(counter_words[:, i], dtype=np.uint64) for i in range(4))
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & M32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & M32, (k1 + np.uint64(0xBB67AE85)) & M32
    return np.stack([c0, c1, c2, c3], axis=1)


def test_reference_matches_the_published_known_answers():
    counters = np.array([[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]],
                        dtype=np.uint64)
    keys = [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (0xA4093822, 0x299F31D0)]
    expected = [[0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
                [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
                [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]]
    for counter, key, words in zip(counters, keys, expected):
        assert philox4x32_10(counter[None, :], key)[0].tolist() == words


def expected_keep(seed, offset, shape, p):
    """Keep decisions of every element of a (B, H, Lq, Lk) score tensor. The counter of block b is
    (offset / 4 as the low 64 bits: words 0 and 1; b as the high 64 bits: words 2 and 3)."""
    n = int(np.prod(shape))
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)
    position = np.uint64(offset // 4)
    counters = np.stack([np.full_like(blocks, position & M32), np.full_like(blocks, position >> np.uint64(32)),
                         blocks & M32, blocks >> np.uint64(32)], axis=1)
    words = philox4x32_10(counters, (seed & 0xFFFFFFFF, seed >> 32)).reshape(-1)[:n]
    uniform = (words >> np.uint64(8)).astype(np.float64) * 2.0 ** -24
    return torch.from_numpy(uniform >= np.float32(p)).reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["no mask", "padding", "causal", "padding and causal"])
def test_cpu_kernel_draws_the_philox_stream(dtype, case):
    torch.manual_seed(0)
    b, h, lq, lk, p = 2, 3, 37, 301, 0.4
    q, k, v = torch.randn(b, h, lq, 8, dtype=dtype), torch.randn(b, h, lk, 8, dtype=dtype), torch.randn(
        b, h, lk, 8, dtype=dtype)
    mask = None
    if "padding" in case:  # the kernel computes only each chunk's visible keys; the draws stay put
        mask = (torch.arange(lk)[None, :] < torch.tensor([29, 200])[:, None])[:, None, None, :]
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
