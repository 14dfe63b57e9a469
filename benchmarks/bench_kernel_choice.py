"""The attention core's CPU kernels against each other and against torch's SDPA, to set and check the kernel
choice (csrc/ops/kernel_choice.cpp).

For each dtype, length and pass (forward under no_grad; forward + backward), one round runs, interleaved:
  own    torch.ops.fastmha.attention with FASTMHA_CPU_KERNELS=own   (fastmha's fused kernels; half types widened
         to fp32, FASTMHA_CPU_HALF_GEMM=widen)
  blas   the same with FASTMHA_CPU_FLOAT_GEMM=blas as well         (float32 only: the forward's P V on the BLAS's
         sgemm, where own runs it as the default does: on oneDNN's brgemm on AMD processors with AVX-512;
         --own-float-gemm blas|brgemm sets own's instead)
  native the same with FASTMHA_CPU_HALF_GEMM=native as well        (half types only: the products of forward and
         backward in the half type on the CPU's own instructions where it has them; the same as own elsewhere)
  stock  the same op with FASTMHA_CPU_KERNELS=stock                 (torch's CPU flash kernel behind the layer)
  auto   the same op with the default choice                        (what users get)
  sdpa   F.scaled_dot_product_attention on the same tensors         (the peer)
Inputs are (B, 8, L, d) with d = --head-dim (64) (queries (B, 8, Lq, d) with --query-length Lq: decoding
steps and short query blocks; masks none, padding or is_causal), dropout 0, need_weights=False (--need-weights: True for
fastmha's calls, which then all run its own kernels), and one of these masks
(--masks), which SDPA gets too (as a bool attn_mask):
  none            no mask
  padding         (B, 1, 1, L) int64, each sequence keeps its first 10-25% of the keys (a padded batch; --kept F:
                  the first F of them in every sequence, to find the share up to which skipping pays)
  padding+causal  (B, 1, L, L) int64, the same padding and the causal triangle (a padded decoder batch)
  causal          (L, L) bool, the causal triangle given as a mask (is_causal not set)
  is_causal       no mask, is_causal=True (top-left aligned; SDPA gets is_causal=True too)
  window          (L, L) bool, a sliding window of 128 keys on each side plus 16 global keys seen by all
  documents       (L, L) bool, block diagonal: sequences of 256 tokens packed into one row
Medians over --repeats rounds; ratios are sdpa time / kernel time (> 1: faster than SDPA). Results are stamped
with the CPU model and ISA.

--gemm adds, for the forward, the efficiency of the default path: "gemm", the forward's two products alone
(S = Q K^T into a preallocated (B, 8, Lq, L) buffer, then S V, torch.matmul in the same dtype, every key), timed in
the same rounds; auto / gemm (1.0: the kernel costs what its products alone cost); and the default's rate in
GFLOP/s (4 d FLOPs for each visible (query, key) pair: all of them without a mask, the causal triangle with
is_causal, the mask's nonzero entries otherwise) as a share of this machine's rate for one large product (torch.mm
of n x n matrices in the same dtype, measured once per dtype: n 4096, 2048 for half types, 256 with --quick).

    python benchmarks/bench_kernel_choice.py --out benchmarks/results/kernel-choice-DATE
    python benchmarks/bench_kernel_choice.py --masks padding,padding+causal --out ...
    python benchmarks/bench_kernel_choice.py --dtypes float32 --head-dim 128 --sizes 2x1024,1x8192 --out ...
    python benchmarks/bench_kernel_choice.py --dtypes bfloat16,float16 --need-weights --out ...  # native vs own
    python benchmarks/bench_kernel_choice.py --dtypes bfloat16 --need-weights --query-length 1 --out ...
    python benchmarks/bench_kernel_choice.py --dtypes float32 --own-float-gemm brgemm --out ...  # brgemm vs blas
    python benchmarks/bench_kernel_choice.py --masks padding --kept 0.55 --sizes 1x4096 --out ...
    python benchmarks/bench_kernel_choice.py --quick     # a smoke run (seconds)
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fastmha
from fastmha.info import cpu_lines

from bench_common import results_file

KERNELS = ["own", "blas", "native", "stock", "auto", "sdpa"]
HALF_TYPES = (torch.bfloat16, torch.float16)
SIZES = [(16, 128), (4, 512), (2, 1024), (1, 4096)]  # (batch, length): about the same work each
QUICK_SIZES = [(2, 64)]
PADDED_SIZES = [(8, 350), (2, 1024), (1, 4096)]  # 350: the textbook's padded sentence length
OWN_FLOAT_GEMM = "auto"  # --own-float-gemm: how the own column multiplies float32's P V
KEPT = None  # --kept: the share of the keys every padded sequence keeps (default: 10-25%, drawn per sequence)
MASKS = ["none", "padding", "padding+causal", "causal", "is_causal", "window", "documents"]


def make_mask(kind, batch, length):
    if kind in ("none", "is_causal"):
        return None
    rows, cols = torch.arange(length)[:, None], torch.arange(length)[None, :]
    if kind == "causal":
        return cols <= rows
    if kind == "window":
        return ((cols - rows).abs() <= 128) | (cols < 16)
    if kind == "documents":
        return rows // 256 == cols // 256
    generator = torch.Generator().manual_seed(batch * length)
    kept = torch.randint(length // 10, length // 4 + 1, (batch,), generator=generator) if KEPT is None else \
        torch.full((batch,), int(KEPT * length))
    visible = torch.arange(length)[None, :] < kept[:, None]
    if kind == "padding":
        return visible[:, None, None, :].to(torch.int64)
    return (visible[:, None, None, :] & torch.ones(length, length, dtype=torch.bool).tril()).to(torch.int64)


def run_once(kernel, q, k, v, mask, backward, need_weights, causal, buffers=None):
    if kernel == "gemm":  # the forward's products alone
        scores, out = buffers
        start = time.perf_counter()
        torch.matmul(q, k.transpose(-1, -2), out=scores)
        torch.matmul(scores, v, out=out)
        return time.perf_counter() - start
    if kernel != "sdpa":
        os.environ["FASTMHA_CPU_KERNELS"] = "own" if kernel in ("native", "blas") else kernel
        if kernel == "blas":
            os.environ["FASTMHA_CPU_FLOAT_GEMM"] = "blas"
        elif kernel == "own" and OWN_FLOAT_GEMM != "auto":
            os.environ["FASTMHA_CPU_FLOAT_GEMM"] = OWN_FLOAT_GEMM
        else:
            os.environ.pop("FASTMHA_CPU_FLOAT_GEMM", None)
        if kernel in ("own", "native", "blas"):
            os.environ["FASTMHA_CPU_HALF_GEMM"] = "native" if kernel == "native" else "widen"
        else:  # the default products, as users get them
            os.environ.pop("FASTMHA_CPU_HALF_GEMM", None)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if kernel == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask != 0,
                                                 is_causal=causal)
        else:
            out, _ = torch.ops.fastmha.attention(q, k, v, mask, 0.0, need_weights, causal)
        if backward:
            out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def visible_pairs(mask, causal, batch, len_q, len_k):
    """The (query, key) pairs a forward must compute, over the batch and the 8 heads: every pair without a mask,
    key <= query with is_causal (top-left aligned), the mask's nonzero entries otherwise."""
    if causal:
        per_head = sum(min(i + 1, len_k) for i in range(len_q))
        return batch * 8 * per_head
    if mask is None:
        return batch * 8 * len_q * len_k
    return 8 * int(torch.broadcast_to(mask != 0, (batch, 1, len_q, len_k)).sum())


def mm_rate(dtype, n, repeats=3):
    """GFLOP/s of torch.mm on two n x n matrices of `dtype`: this machine's rate for one large product."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def measure(dtype, batch, length, head_dim, mask_kind, backward, repeats, need_weights, query_length=None,
            gemm=False):
    q, k, v = (torch.randn(batch, 8, n, head_dim, dtype=dtype, requires_grad=backward)
               for n in (query_length or length, length, length))
    mask, causal = make_mask(mask_kind, batch, length), mask_kind == "is_causal"
    kernels = [kernel for kernel in KERNELS
               if (kernel != "native" or dtype in HALF_TYPES) and (kernel != "blas" or dtype == torch.float32)]
    buffers = None
    if gemm and not backward:
        kernels.append("gemm")
        buffers = (torch.empty(batch, 8, q.size(2), length, dtype=dtype), torch.empty_like(q))
    times = {kernel: [] for kernel in kernels}
    for kernel in kernels:  # warm-up
        run_once(kernel, q, k, v, mask, backward, need_weights, causal, buffers)
    for _ in range(repeats):
        for kernel in kernels:
            times[kernel].append(run_once(kernel, q, k, v, mask, backward, need_weights, causal, buffers))
    os.environ.pop("FASTMHA_CPU_KERNELS", None)
    os.environ.pop("FASTMHA_CPU_HALF_GEMM", None)
    os.environ.pop("FASTMHA_CPU_FLOAT_GEMM", None)
    choice = fastmha.explain(q, k, v, mask, need_weights=need_weights, is_causal=causal).splitlines()
    medians = {kernel: statistics.median(t) for kernel, t in times.items()}
    gemm_ms = medians.pop("gemm", None)
    auto_gflops = None
    if gemm_ms is not None:
        flops = 4 * head_dim * visible_pairs(mask, causal, batch, q.size(2), length)
        auto_gflops = round(flops / medians["auto"] / 1e9, 1)
    return {
        "dtype": str(dtype).replace("torch.", ""), "batch": batch, "length": length, "head_dim": head_dim,
        "query_length": query_length or length,
        "mask": mask_kind, "need_weights": need_weights,
        "pass": "fwd+bwd" if backward else "fwd", "ms": {k: round(t * 1e3, 3) for k, t in medians.items()},
        "sdpa_over": {k: round(medians["sdpa"] / medians[k], 3) for k in medians if k != "sdpa"},
        "auto_runs": [line.split(":")[0] for line in choice],
        "gemm_ms": None if gemm_ms is None else round(gemm_ms * 1e3, 3),
        "auto_over_gemm": None if gemm_ms is None else round(medians["auto"] / gemm_ms, 3),
        "auto_gflops": auto_gflops,
    }


def half_products_lines():
    """Whether this CPU multiplies each half type natively (what the native column measures)."""
    lines = []
    os.environ["FASTMHA_CPU_FLOAT_GEMM"] = "blas"  # no note of the widened products' float32 GEMM after the half one
    for dtype in HALF_TYPES:
        os.environ["FASTMHA_CPU_HALF_GEMM"] = "native"
        q = torch.randn(1, 1, 4, 8, dtype=dtype)
        note = fastmha.explain(q, q, q).splitlines()[0].split("; ")[-1]
        lines.append(f"native column, {str(dtype).replace('torch.', '')}: {note}")
    os.environ.pop("FASTMHA_CPU_HALF_GEMM", None)
    os.environ.pop("FASTMHA_CPU_FLOAT_GEMM", None)
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--masks", default="none", help=f"comma-separated, of {MASKS}")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--sizes", help="comma-separated BATCHxLENGTH (default: a list per mask kind)")
    parser.add_argument("--need-weights", action="store_true", help="fastmha's calls keep the weights")
    parser.add_argument("--query-length", type=int, help="queries per head (default: the keys' length)")
    parser.add_argument("--gemm", action="store_true", help="the forward's efficiency: its products alone")
    parser.add_argument("--own-float-gemm", choices=["auto", "blas", "brgemm"], default="auto",
                        help="FASTMHA_CPU_FLOAT_GEMM of the own column (default: the default's choice)")
    parser.add_argument("--kept", type=float, help="share of the keys every padded sequence keeps (0 to 1)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    global OWN_FLOAT_GEMM, KEPT
    OWN_FLOAT_GEMM, KEPT = args.own_float_gemm, args.kept
    if KEPT is not None and not 0 < KEPT <= 1:
        parser.error(f"--kept must lie in (0, 1], got {KEPT}")
    chosen_sizes = [tuple(int(n) for n in size.split("x")) for size in args.sizes.split(",")] if args.sizes else None
    masks = args.masks.split(",")
    if unknown := set(masks) - set(MASKS):
        parser.error(f"unknown masks {sorted(unknown)}; choose from {MASKS}")
    if args.query_length and set(masks) - {"none", "padding", "is_causal"}:
        parser.error("--query-length takes the masks none, padding and is_causal")
    repeats = 1 if args.quick else args.repeats
    stamp = cpu_lines()
    header = [f"fastmha {fastmha.__version__} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
              f"{datetime.date.today()}", *stamp, *half_products_lines(),
              f"own column's float32 P V: FASTMHA_CPU_FLOAT_GEMM={args.own_float_gemm}",
              f"padded sequences keep: {'10-25% of the keys' if KEPT is None else f'{KEPT:.0%} of the keys'}"]
    peak = {}
    if args.gemm:
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            n = 256 if args.quick else 2048 if dtype in HALF_TYPES else 4096  # half types: slow without native mm
            peak[dtype_name] = mm_rate(dtype, n)
            header.append(f"torch.mm rate, {dtype_name}, {n} x {n}: {peak[dtype_name]:.0f} GFLOP/s")
    print("\n".join(header), flush=True)
    rows = []
    for mask_kind in masks:
        default_sizes = SIZES if mask_kind in ("none", "is_causal") else PADDED_SIZES
        sizes = QUICK_SIZES if args.quick else chosen_sizes or default_sizes
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for batch, length in sizes:
                for backward in (False, True):
                    row = measure(dtype, batch, length, args.head_dim, mask_kind, backward, repeats,
                                  args.need_weights, args.query_length, args.gemm)
                    if row["gemm_ms"] is not None:
                        row["auto_share_of_mm_rate"] = round(row["auto_gflops"] / peak[dtype_name], 3)
                    rows.append(row)
                    print(f"{mask_kind:14s} {row['dtype']:9s} B{batch:3d} Lq{row['query_length']:5d} L{length:5d} "
                          f"d{args.head_dim} "
                          f"{row['pass']:8s} "
                          + " ".join(f"{k} {t:9.2f} ms" for k, t in row["ms"].items())
                          + " | " + " ".join(f"sdpa/{k} {r:.2f}" for k, r in row["sdpa_over"].items())
                          + (f" | gemm {row['gemm_ms']:.2f} ms auto/gemm {row['auto_over_gemm']:.2f} "
                             f"{row['auto_gflops']:.0f} GFLOP/s ({row['auto_share_of_mm_rate']:.0%} of mm)"
                             if row["gemm_ms"] is not None else ""),
                          flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results_file(args.out, ".json").write_text(json.dumps({"machine": header, "rows": rows}, indent=1) + "\n")
        gemm_head = " gemm ms | auto/gemm | auto GFLOP/s | share of mm |" if args.gemm else ""
        lines = ["# CPU kernel choice: fastmha's kernel, torch's flash kernel, the default choice, and SDPA", "",
                 *[f"- {line}" for line in header], "",
                 f"(B, 8, L, {args.head_dim}), queries (B, 8, {args.query_length or 'L'}, {args.head_dim}), "
                 f"dropout 0, need_weights={args.need_weights} for fastmha's calls, "
                 "masks as in the script's docstring (SDPA gets the same mask); medians of "
                 f"{repeats}; ratio = SDPA time / kernel time (> 1: faster than SDPA); blas: float32 only; "
                 "native: half types only."
                 + (" gemm: the forward's products alone (see the script's docstring)." if args.gemm else ""), "",
                 "| mask | dtype | B | L | pass | own ms | blas ms | native ms | stock ms | auto ms | SDPA ms "
                 "| SDPA/own | SDPA/blas | SDPA/native | SDPA/stock | SDPA/auto | auto runs |" + gemm_head,
                 "|---" * 17 + "|" + "---|" * (4 if args.gemm else 0)]
        for r in rows:
            ms, over = r["ms"], r["sdpa_over"]
            efficiency = ""
            if args.gemm:
                efficiency = (f" {r['gemm_ms']} | {r['auto_over_gemm']} | {r['auto_gflops']} | "
                              f"{r['auto_share_of_mm_rate']} |" if r["gemm_ms"] is not None else " - | - | - | - |")
            lines.append(f"| {r['mask']} | {r['dtype']} | {r['batch']} | {r['length']} | {r['pass']} | "
                         f"{ms['own']} | {ms.get('blas', '-')} | {ms.get('native', '-')} | {ms['stock']} | "
                         f"{ms['auto']} | {ms['sdpa']} | {over['own']} | {over.get('blas', '-')} | "
                         f"{over.get('native', '-')} | {over['stock']} | {over['auto']} | "
                         f"{', '.join(r['auto_runs'])} |" + efficiency)
        results_file(args.out, ".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
