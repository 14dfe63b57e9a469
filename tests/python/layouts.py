"""Memory layouts of (B, H, L, d) attention inputs that callers pass, for the tests that check every kernel path
reads its operands through their strides."""

import torch


def heads_interleaved(b, h, length, d, dtype):
    """The head split of a (B, L, H * d) projection, as the block and the textbook split theirs."""
    return torch.randn(b, length, h * d, dtype=dtype).view(b, length, h, d).transpose(1, 2)


def contiguous(b, h, length, d, dtype):
    return torch.randn(b, h, length, d, dtype=dtype)


def strided_rows(b, h, length, d, dtype):
    """Every other element of a wider tensor: the rows are not of unit stride."""
    return torch.randn(b, h, length, 2 * d, dtype=dtype)[..., ::2]


def relaid(t, kind):
    """The values of t in another memory layout (the head dimension's stride is not 1 in most)."""
    if kind == "contiguous":
        return t
    if kind == "transposed storage":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "every other element":
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "heads outermost":
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    raise ValueError(f"unknown layout {kind!r}")


RELAYOUTS = ["contiguous", "transposed storage", "every other element", "heads outermost"]
