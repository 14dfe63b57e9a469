"""The block's float32 projections on the BLAS or on oneDNN (FASTMHA_CPU_FLOAT_GEMM).

Two parts, each interleaved, medians of --repeats rounds, results stamped with the CPU model and ISA:
  products  x W^T for x (rows, features) and W (features, features): torch's linear (the BLAS's sgemm, what
            FASTMHA_CPU_FLOAT_GEMM=blas runs) against torch's oneDNN linear (mkldnn::_linear_pointwise, what
            `brgemm`, and `auto` on AMD processors with AVX-512, run from 512 rows on); ratio = blas / oneDNN
  block     fastmha's block (d_model 512, h 8, weights kept, dropout 0.1, self-attention without a mask), forward
            without grad, forward + backward, and the backward alone (of a graph made once), with the switch at
            `blas` and at `auto` in turn in one process (`blas` also runs the forward's P V and the backward's
            projections on sgemm); ratio = blas / auto

    python benchmarks/bench_projections.py --out benchmarks/results/cpu-projections-DATE-CPU
    python benchmarks/bench_projections.py --quick     # a smoke run (seconds)
"""

import os
import sys

import torch

import fastmha
from bench_common import interleaved_ms, markdown, start, write_results

PRODUCTS = [(rows, features) for features in (256, 512, 1024) for rows in (64, 256, 512, 1024, 2800, 4096)]
BLOCKS = [(8, 512), (4, 1024)]
QUICK_PRODUCTS, QUICK_BLOCKS = [(512, 32)], [(1, 512)]


def product_row(rows, features, repeats):
    x, weight = torch.randn(rows, features), torch.randn(features, features)
    onednn = torch.ops.mkldnn._linear_pointwise
    ms = interleaved_ms({"blas": lambda: torch.nn.functional.linear(x, weight),
                         "onednn": lambda: onednn(x, weight, None, "none", [], None)}, repeats)
    return {"part": "products", "rows": rows, "features": features, "ms": ms,
            "ratio": round(ms["blas"] / ms["onednn"], 3)}


def with_switch(mode, fn):
    def call():
        os.environ["FASTMHA_CPU_FLOAT_GEMM"] = mode
        return fn()
    return call


def block_rows(batch, length, repeats):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(512, 8, 0.1).train()
    x = torch.randn(batch, length, 512, requires_grad=True)

    def forward():
        with torch.no_grad():
            block(x, x, x, None)

    def forward_backward():
        block(x, x, x, None).sum().backward()

    def backward_under(switch):
        """The backward alone, of a graph made once under `switch` (the backward's projections are all that
        the switch moves there)."""
        out = with_switch(switch, lambda: block(x, x, x, None))()
        grad = torch.randn_like(out)
        return with_switch(switch, lambda: out.backward(grad, retain_graph=True))

    rows = []
    for mode, fn in (("forward", forward), ("forward + backward", forward_backward), ("backward", None)):
        calls = {switch: backward_under(switch) if fn is None else with_switch(switch, fn)
                 for switch in ("blas", "auto")}
        ms = interleaved_ms(calls, repeats)
        rows.append({"part": "block", "batch": batch, "length": length, "mode": mode, "ms": ms,
                     "ratio": round(ms["blas"] / ms["auto"], 3)})
    return rows


def main():
    args, repeats, header = start(__doc__, 11)
    saved = os.environ.get("FASTMHA_CPU_FLOAT_GEMM")
    products, blocks = [], []
    try:
        for rows, features in QUICK_PRODUCTS if args.quick else PRODUCTS:
            products.append(product_row(rows, features, repeats))
            print(f"x W^T {rows} x {features}: blas {products[-1]['ms']['blas']:.3f} ms, oneDNN "
                  f"{products[-1]['ms']['onednn']:.3f} ms ({products[-1]['ratio']}x)", flush=True)
        for batch, length in QUICK_BLOCKS if args.quick else BLOCKS:
            for row in block_rows(batch, length, repeats):
                blocks.append(row)
                print(f"block B{batch} L{length} {row['mode']}: blas {row['ms']['blas']:.1f} ms, auto "
                      f"{row['ms']['auto']:.1f} ms ({row['ratio']}x)", flush=True)
    finally:
        if saved is None:
            os.environ.pop("FASTMHA_CPU_FLOAT_GEMM", None)
        else:
            os.environ["FASTMHA_CPU_FLOAT_GEMM"] = saved
    if args.out:
        setup = (f"float32, interleaved, medians of {repeats}. x W^T on torch's linear (BLAS) and on torch's oneDNN "
                 "linear; ratio = BLAS / oneDNN.")
        page = markdown("# The block's float32 projections: BLAS or oneDNN", header, setup,
                        {"rows": lambda r: r["rows"], "features": lambda r: r["features"],
                         "BLAS ms": lambda r: round(r["ms"]["blas"], 3),
                         "oneDNN ms": lambda r: round(r["ms"]["onednn"], 3), "ratio": lambda r: r["ratio"]}, products)
        page += "\n" + markdown(
            "## The block", [], "d_model 512, h 8, weights kept, dropout 0.1, self-attention; FASTMHA_CPU_FLOAT_GEMM="
            "blas and auto in turn (blas also runs the forward's P V and the backward's projections on sgemm); "
            "ratio = blas / auto.",
            {"B": lambda r: r["batch"], "L": lambda r: r["length"], "mode": lambda r: r["mode"],
             "blas ms": lambda r: round(r["ms"]["blas"], 1), "auto ms": lambda r: round(r["ms"]["auto"], 1),
             "ratio": lambda r: r["ratio"]}, blocks)
        write_results(args.out, header, products + blocks, page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
