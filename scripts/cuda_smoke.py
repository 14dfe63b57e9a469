"""Small calls through every fastmha CUDA kernel, for compute-sanitizer (memcheck, racecheck, synccheck).

Both paths (flash and weights kept), forward and backward, every dtype and padded head size, with a mask
that has fully masked rows, is_causal, dropout and lengths that end mid-tile. Exits non-zero on a wrong
result (against the CPU kernels), so a sanitizer run also checks the numbers.
"""

import sys

import torch

import fastmha  # noqa: F401


def main():
    if not torch.cuda.is_available():
        print("cuda_smoke: no CUDA device, nothing to do")
        return 0
    torch.manual_seed(0)
    failures = 0
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        for d_k, d_v in ((16, 16), (100, 72), (200, 256)):
            for need_weights in (False, True):
                for is_causal, p in ((False, 0.0), (True, 0.0), (False, 0.2)):
                    q = torch.randn(1, 2, 67, d_k, dtype=dtype)
                    k = torch.randn(1, 2, 45, d_k, dtype=dtype)
                    v = torch.randn(1, 2, 45, d_v, dtype=dtype)
                    mask = torch.rand(1, 1, 67, 45) > 0.3
                    mask[..., 2, :] = False
                    args = [x.cuda().requires_grad_(True) for x in (q, k, v)]
                    out, _ = torch.ops.fastmha.attention(*args, mask.cuda(), p, need_weights, is_causal)
                    out.float().sum().backward()
                    torch.cuda.synchronize()
                    if p == 0.0:
                        ref, _ = torch.ops.fastmha.attention(q.double(), k.double(), v.double(), mask, 0.0, False,
                                                             is_causal)
                        error = (out.double().cpu() - ref).abs().max().item()
                        if not error < 5e-2:
                            print(f"cuda_smoke: {dtype} d_k={d_k} d_v={d_v} weights={need_weights} "
                                  f"causal={is_causal}: max error {error}")
                            failures += 1
    print(f"cuda_smoke: done, {failures} wrong results")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
