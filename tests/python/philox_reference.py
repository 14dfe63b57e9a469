"""Philox4x32-10 written from its specification (Salmon et al., SC 2011) in NumPy, and the keep decisions of
fastmha's dropout derived from it: element e of the (B, H, Lq, Lk) score layout keeps its weight iff the
uniform of word e % 4 of block e // 4 is >= p."""

import numpy as np
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
