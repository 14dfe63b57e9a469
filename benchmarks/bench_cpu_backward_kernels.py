"""The CPU backward without kept weights: fastmha's blocked kernel against torch's CPU flash backward.

Both run `torch.ops.fastmha._attention_backward` on the same forward's saved tensors, interleaved, the kernel forced
with FASTMHA_CPU_KERNELS (own: fastmha's; stock: torch's `_scaled_dot_product_flash_attention_for_cpu_backward`
behind the contract layer). Inputs are (B, 8, L, d), dropout 0; masks: none, or a lightly padded batch ((B, 1, 1, L)
int64 keeping 85-100% of the keys, where fastmha's kernel has little to skip). Medians over --repeats rounds; the
ratio is stock time / own time (> 1: fastmha's is faster). Results are stamped with the CPU model and ISA.

    python benchmarks/bench_cpu_backward_kernels.py --out benchmarks/results/cpu-backward-kernels-DATE
    python benchmarks/bench_cpu_backward_kernels.py --half --out ...   # bfloat16 and float16
    python benchmarks/bench_cpu_backward_kernels.py --quick     # a smoke run (seconds)
"""

import os
import sys

import torch

import fastmha  # noqa: F401 (loads the ops)
from bench_common import interleaved_ms, markdown, start, write_results

OPS = torch.ops.fastmha
# (dtype, mask, head_dim, batch, length)
LONG = ((4, 1024), (2, 2048), (1, 4096), (1, 8192))
CASES = [("float32", "none", d, b, length) for d in (64, 128) for b, length in LONG]
CASES += [("float64", "none", 64, b, length) for b, length in ((2, 2048), (1, 4096))]
CASES += [("float32", "padding", 64, b, length) for b, length in ((2, 2048), (1, 4096))]
# --half: bfloat16 and float16 over short and long keys, fastmha's products as the default takes them
# (native on CPUs that multiply the type, widened to fp32 elsewhere or below the limits of rows and keys)
SHORT_AND_LONG = ((16, 128), (8, 256), (4, 512), (2, 1024), (1, 2048), (1, 4096))
HALF_CASES = [(dtype, "none", d, b, length) for dtype in ("bfloat16", "float16") for d in (64, 128)
              for b, length in SHORT_AND_LONG]
QUICK_HALF_CASES = [("bfloat16", "none", 64, 1, 128), ("float16", "none", 64, 1, 128)]
QUICK_CASES = [("float32", "none", 64, 1, 128), ("float32", "padding", 64, 1, 128)]


def light_padding(batch, length):
    kept = torch.randint(int(0.85 * length), length + 1, (batch,))
    return (torch.arange(length)[None, :] < kept[:, None]).long().view(batch, 1, 1, length)


def measure(dtype, mask_kind, head_dim, batch, length, repeats):
    q, k, v = (torch.randn(batch, 8, length, head_dim, dtype=getattr(torch, dtype)) for _ in range(3))
    mask = light_padding(batch, length) if mask_kind == "padding" else None
    os.environ["FASTMHA_CPU_KERNELS"] = "own"
    out, _, lse, rng_state = OPS._attention_forward(q, k, v, mask, 0.0, False, False)
    args = (torch.randn_like(out), None, q, k, v, mask, out, lse, rng_state, 0.0, False)

    def backward_on(kernel):
        os.environ["FASTMHA_CPU_KERNELS"] = kernel
        OPS._attention_backward(*args)

    ms = interleaved_ms({kernel: lambda kernel=kernel: backward_on(kernel) for kernel in ("own", "stock")}, repeats)
    return {"dtype": dtype, "mask": mask_kind, "head_dim": head_dim, "batch": batch, "length": length,
            "ms": {kernel: round(t, 3) for kernel, t in ms.items()}, "ratio": round(ms["stock"] / ms["own"], 2)}


COLUMNS = {"dtype": lambda r: r["dtype"], "mask": lambda r: r["mask"], "d": lambda r: r["head_dim"],
           "B": lambda r: r["batch"], "L": lambda r: r["length"], "own ms": lambda r: r["ms"]["own"],
           "stock ms": lambda r: r["ms"]["stock"], "stock / own": lambda r: r["ratio"]}


def results_page(header, rows, repeats):
    title = "# CPU backward without kept weights: fastmha's kernel against torch's flash backward"
    setup = (f"`_attention_backward` on one forward's saved tensors, (B, 8, L, d), dropout 0, interleaved, medians "
             f"of {repeats}; padding keeps 85-100% of the keys; ratio = stock / own (> 1: fastmha's is faster).")
    return markdown(title, header, setup, COLUMNS, rows)


def main():
    args, repeats, header = start(
        __doc__, 5, lambda parser: parser.add_argument("--half", action="store_true", help="bfloat16 and float16"))
    rows = []
    if args.half:
        cases = QUICK_HALF_CASES if args.quick else HALF_CASES
    else:
        cases = QUICK_CASES if args.quick else CASES
    for case in cases:
        row = measure(*case, repeats)
        rows.append(row)
        print(" | ".join(f"{name} {cell(row)}" for name, cell in COLUMNS.items()), flush=True)
    if args.out:
        write_results(args.out, header, rows, results_page(header, rows, repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
