"""Small calls through every fastmha CUDA kernel, for compute-sanitizer (memcheck, racecheck, synccheck).

Both paths (flash and weights kept), forward and backward, every dtype and padded head size, with a mask
that has fully masked rows, is_causal, dropout and lengths that end mid-tile (and the weights kept over rows of
256 to 9000 keys, every shape of the row kernels), in inputs both contiguous and
transposed (a (B, L, H, d) tensor viewed as (B, H, L, d), which takes the element-wise loads). The calls run
four times: with FASTMHA_CUDA_KERNELS=own, which sends every call without kept weights to fastmha's flash
kernels, again with FASTMHA_CUDA_FLASH=mma and mma16 (the register-resident forward and backward in half types
with head sizes up to 128), then with FASTMHA_CUDA_KERNELS=aten for the calls that still run a fastmha kernel
there (dropout without kept weights: the ATen composite draws through fastmha's dropout kernel, as it does where
the flash kernels cannot run). Exits non-zero on a wrong result (against the CPU kernels), so a sanitizer run also checks the numbers.
"""

import os
import sys

import torch

import fastmha  # noqa: F401


def cuda_input(x, transposed):
    """x on the GPU, requiring grad; transposed: the same values in a (B, L, H, d) tensor's strides."""
    if transposed:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    return x.cuda().requires_grad_(True)


def check(dtype, d_k, d_v, need_weights, is_causal, p, transposed, mode, len_k=45):
    """One forward and backward on the GPU; without dropout its output against the CPU kernels in float64. Rows
    of other than 45 keys also take a gradient through the kept weights (the row kernels' backward)."""
    q = torch.randn(1, 2, 67, d_k, dtype=dtype)
    k = torch.randn(1, 2, len_k, d_k, dtype=dtype)
    v = torch.randn(1, 2, len_k, d_v, dtype=dtype)
    mask = torch.rand(1, 1, 67, len_k) > 0.3
    mask[..., 2, :] = False
    args = [cuda_input(x, transposed) for x in (q, k, v)]
    out, weights = torch.ops.fastmha.attention(*args, mask.cuda(), p, need_weights, is_causal)
    loss = out.float().sum()
    if need_weights and len_k != 45:
        loss = loss + weights.float().square().sum()
    loss.backward()
    torch.cuda.synchronize()
    if p > 0.0:
        return True
    ref, _ = torch.ops.fastmha.attention(q.double(), k.double(), v.double(), mask, 0.0, False, is_causal)
    error = (out.double().cpu() - ref).abs().max().item()
    if error < 5e-2:
        return True
    print(f"cuda_smoke: FASTMHA_CUDA_KERNELS={mode} {dtype} d_k={d_k} d_v={d_v} weights={need_weights} "
          f"causal={is_causal} transposed={transposed}: max error {error}")
    return False


def main():
    if not torch.cuda.is_available():
        print("cuda_smoke: no CUDA device, nothing to do")
        return 0
    torch.manual_seed(0)
    failures = 0
    for mode in ("own", "own-mma", "own-mma16", "aten"):
        kernels, _, forward = mode.partition("-")
        os.environ["FASTMHA_CUDA_KERNELS"] = kernels  # read at every call
        os.environ["FASTMHA_CUDA_FLASH"] = forward or "auto"
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            for d_k, d_v in ((16, 16), (100, 72), (200, 256)):
                for need_weights in (False, True):
                    for is_causal, p in ((False, 0.0), (True, 0.0), (False, 0.2)):
                        if mode == "aten" and (need_weights or p == 0.0):
                            continue  # only the composite's dropout runs fastmha's code there
                        if "mma" in mode and (need_weights or dtype.itemsize != 2 or max(d_k, d_v) > 128):
                            continue  # the calls the mma forward takes
                        transposed = d_k == 16 and not is_causal
                        failures += not check(dtype, d_k, d_v, need_weights, is_causal, p, transposed, mode)
            if mode == "own":  # the weights-kept row kernels' shapes with vector and scalar runs, a block a row
                for len_k, p in ((256, 0.0), (701, 0.0), (1500, 0.2), (2048, 0.0), (4098, 0.0), (9000, 0.0)):
                    failures += not check(dtype, 64, 64, True, False, p, False, mode, len_k)
    print(f"cuda_smoke: done, {failures} wrong results")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
