"""The CPU backward of a call that kept its weights: reading them against recomputing them.

For each size and mask, one round runs, interleaved, on the same forward's saved tensors:
  recompute  torch.ops.fastmha._attention_backward without the weights (scores recomputed from the log-sum-exp)
  weights    the same op given the forward's kept weights, as autograd passes them (float32 and float64 without
             dropout, float32 with dropout up to 0.1)
Inputs are (B, 8, L, d) in --dtype (float32 or float64) with d = --head-dim (64), dropout --dropout (0; with
dropout the weights hold P times the dropout multipliers, and the op recomputes only the dropped ones), fastmha's
own CPU kernels; masks: none, or a padded batch ((B, 1, 1, L) int64, each sequence keeping its first 10-25% of the
keys). Medians over --repeats rounds; the ratio is
recompute time / weights time (> 1: reading the weights is faster). Results are stamped with the CPU model and ISA.

    python benchmarks/bench_backward_from_weights.py --out benchmarks/results/cpu-backward-from-weights-DATE
    python benchmarks/bench_backward_from_weights.py --quick     # a smoke run (seconds)
"""

import argparse
import os
import sys
from pathlib import Path

import torch

import fastmha  # noqa: F401 (loads the ops)
from bench_common import interleaved_ms, machine_header, markdown, write_results

OPS = torch.ops.fastmha
SIZES = [(8, 512), (4, 1024), (1, 4096)]
QUICK_SIZES = [(1, 128)]


def padding_mask(batch, length):
    kept = torch.randint(int(0.10 * length), int(0.25 * length) + 1, (batch,))
    return (torch.arange(length)[None, :] < kept[:, None]).long().view(batch, 1, 1, length)


def measure(batch, length, head_dim, mask_kind, repeats, dropout_p, dtype):
    q, k, v = (torch.randn(batch, 8, length, head_dim, dtype=dtype) for _ in range(3))
    mask = padding_mask(batch, length) if mask_kind == "padding" else None
    out, weights, lse, rng_state = OPS._attention_forward(q, k, v, mask, dropout_p, True, False)
    grad_out = torch.randn_like(out)
    args = (grad_out, None, q, k, v, mask, out, lse, rng_state, dropout_p, False)
    calls = {"recompute": lambda: OPS._attention_backward(*args),
             "weights": lambda: OPS._attention_backward(*args, weights)}
    ms = {name: round(t, 2) for name, t in interleaved_ms(calls, repeats).items()}
    return {"batch": batch, "length": length, "head_dim": head_dim, "mask": mask_kind, "dropout": dropout_p,
            "dtype": str(dtype).removeprefix("torch."),
            "ms": ms, "ratio": round(ms["recompute"] / ms["weights"], 2)}


COLUMNS = {"mask": lambda r: r["mask"], "B": lambda r: r["batch"], "L": lambda r: r["length"],
           "recompute ms": lambda r: r["ms"]["recompute"], "weights ms": lambda r: r["ms"]["weights"],
           "ratio": lambda r: r["ratio"]}


def results_page(header, rows, head_dim, repeats, dropout_p, dtype):
    title = "# CPU backward of a call that kept its weights: reading them or recomputing them"
    setup = (f"(B, 8, L, {head_dim}) {str(dtype).removeprefix('torch.')}, dropout {dropout_p}, fastmha's own CPU "
             f"kernels, `_attention_backward` on one forward's saved tensors, interleaved, medians of {repeats}; "
             "ratio = recompute / weights.")
    return markdown(title, header, setup, COLUMNS, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0, help="the forward's dropout probability")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.environ["FASTMHA_CPU_KERNELS"] = "own"
    repeats = 1 if args.quick else args.repeats
    dtype = getattr(torch, args.dtype)
    header = machine_header()
    print("\n".join(header), flush=True)
    rows = []
    for mask_kind in ("none", "padding"):
        for batch, length in QUICK_SIZES if args.quick else SIZES:
            row = measure(batch, length, args.head_dim, mask_kind, repeats, args.dropout, dtype)
            rows.append(row)
            print(f"{mask_kind:8s} B{batch} L{length} d{args.head_dim} recompute {row['ms']['recompute']:8.2f} ms  "
                  f"weights {row['ms']['weights']:8.2f} ms  ratio {row['ratio']:.2f}", flush=True)
    if args.out:
        page = results_page(header, rows, args.head_dim, repeats, args.dropout, dtype)
        write_results(args.out, header, rows, page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
