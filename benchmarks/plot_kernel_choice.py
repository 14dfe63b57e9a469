"""Plots results of bench_kernel_choice.py: the default's speed against SDPA's (SDPA time / default time, above 1:
fastmha faster) over the keys' length, one panel per mask and head size, one line per dtype and pass.

    python benchmarks/plot_kernel_choice.py RESULT.json [RESULT.json ...] --out PLOT.png [--column auto]

Results of several runs go into one figure (a later row of the same case replaces an earlier one); the title
carries each run's machine lines (CPU model, ISA, torch) as recorded, so a figure is stamped as its tables are.
"""

import argparse
import json
import sys
from pathlib import Path

PASS_STYLE = {"fwd": "-", "fwd+bwd": "--"}
DTYPE_COLOR = {"float32": "tab:blue", "float64": "tab:purple", "bfloat16": "tab:orange", "float16": "tab:green"}


def load(paths):
    """The rows of all runs, keyed by their case, and the distinct machine lines (CPU, ISA) of the runs."""
    cases, machines = {}, []
    for path in paths:
        result = json.loads(Path(path).read_text())
        stamp = [line for line in result["machine"] if line.startswith(("cpu:", "cpu isa:", "fastmha"))]
        if stamp not in machines:
            machines.append(stamp)
        for row in result["rows"]:
            key = (row["mask"], row["head_dim"], row["query_length"] == row["length"], row["need_weights"],
                   row["dtype"], row["pass"], row["length"])
            cases[key] = row
    return cases, machines


def plot(cases, machines, column, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(mask, d, full, kept) for mask, d, full, kept, *_ in cases})
    if not panels:
        raise SystemExit("no rows to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        lines = sorted({(dtype, step) for (*p, dtype, step, _) in cases if tuple(p) == panel})
        for dtype, step in lines:
            rows = sorted((r for (*p, t, s, _), r in cases.items() if tuple(p) == panel and (t, s) == (dtype, step)),
                          key=lambda r: r["length"])
            ax.plot([r["length"] for r in rows], [r["sdpa_over"][column] for r in rows], PASS_STYLE.get(step, ":"),
                    marker="o", markersize=3, color=DTYPE_COLOR.get(dtype), label=f"{dtype} {step}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        mask, d, full, kept = panel
        ax.set_title(f"mask {mask}, d_k {d}" + ("" if full else ", fewer queries") + (", weights kept" if kept else ""),
                     fontsize=9)
        ax.set_xlabel("keys (L)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(f"SDPA time / {column} time")
    lowest = min(r["sdpa_over"][column] for r in cases.values())
    axes[0][0].set_ylim(bottom=min(0.8, 0.95 * lowest))
    fig.suptitle("\n".join(line for stamp in machines for line in stamp), fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="JSON files written by bench_kernel_choice.py --out")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--column", default="auto", choices=["auto", "own", "native", "stock", "blas"],
                        help="which of the run's kernels to set against SDPA (default: the default choice)")
    args = parser.parse_args()
    cases, machines = load(args.results)
    missing = sorted({r["dtype"] for r in cases.values() if args.column not in r["sdpa_over"]})
    if missing:
        raise SystemExit(f"--column {args.column} was not measured for {', '.join(missing)}")
    plot(cases, machines, args.column, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
