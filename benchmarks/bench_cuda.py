"""fastmha's CUDA attention core against its peers, in one run: TFLOP/s and peak memory.

Peers, on the same (B, H, L, d) bfloat16 inputs:
  fastmha        torch.ops.fastmha.attention, need_weights=False, the default kernel choice (which kernel ran
                 is recorded in fastmha_kernel: fastmha.explain's forward line)
  fastmha_own    the same with FASTMHA_CUDA_KERNELS=own (fastmha's flash kernels)
  fastmha_mma    the same with FASTMHA_CUDA_FLASH=mma too (the register-resident mma kernels, the forward
                 with 32 query rows per warp)
  fastmha_mma16  the same with FASTMHA_CUDA_FLASH=mma16 (the forward with 16 rows per warp, Q in registers)
  fastmha_sdpa   the default with FASTMHA_CUDA_MASKED=sdpa and FASTMHA_CUDA_DROPOUT=sdpa: masked and dropout
                 calls on SDPA's memory-efficient kernel behind the contract layer, dropout drawing torch's own
                 masks (measured for those calls only)
  fastmha_w      the same with need_weights=True (cuBLAS scores + the fused softmax row kernel)
  sdpa           F.scaled_dot_product_attention as torch picks its backend (recorded in sdpa_backend)
  sdpa_flash / sdpa_efficient / sdpa_cudnn / sdpa_math   each SDPA backend forced (n/a where it refuses)
  oracle         the textbook formulas in eager PyTorch (masked_fill -1e9, softmax, dropout, @ v)

TFLOP/s use the FlashAttention convention: forward 4 B H L^2 d (halved for causal), forward + backward 3.5x
that, padded keys included (what SDPA computes; fastmha's flash kernels skip tiles a mask hides, which shows as
a higher rate). Peak memory is torch.cuda.max_memory_allocated() over one call, above what the inputs hold.
B = 16384 / L and H = 2048 / d (16k tokens of width 2048), as FlashAttention's benchmark does.

    python benchmarks/bench_cuda.py --out DIR             # the H200 matrix (a few minutes)
    python benchmarks/bench_cuda.py --smoke --device cpu  # the harness on tiny shapes, no GPU needed
"""

import argparse
import csv
import datetime
import io
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastmha

ROOT = Path(__file__).resolve().parents[1]
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_math": SDPBackend.MATH}
PEERS = ["fastmha", "fastmha_own", "fastmha_mma", "fastmha_mma16", "fastmha_sdpa", "fastmha_w", "sdpa",
         *SDPA_BACKENDS, "oracle"]
SWITCHED = {"fastmha_own": {"FASTMHA_CUDA_KERNELS": "own"},
            "fastmha_mma": {"FASTMHA_CUDA_KERNELS": "own", "FASTMHA_CUDA_FLASH": "mma"},
            "fastmha_mma16": {"FASTMHA_CUDA_KERNELS": "own", "FASTMHA_CUDA_FLASH": "mma16"},
            "fastmha_sdpa": {"FASTMHA_CUDA_MASKED": "sdpa", "FASTMHA_CUDA_DROPOUT": "sdpa"}}
QUADRATIC_MEMORY = {"fastmha_w", "sdpa_math", "oracle"}  # keep an L x L tensor per head
# is_causal, dropout. "padding": the last quarter of the keys is padding; "padded": a padded batch, each sequence
# keeping 10-25% of the keys (75-90% padding, as sentences padded to a fixed length).
CASES = {"none": (False, 0.0), "causal": (True, 0.0), "padded+dropout": (False, 0.1), "padding": (False, 0.0),
         "padding+dropout": (False, 0.1)}


def make_inputs(batch, heads, length, d, case, device, dtype, requires_grad):
    q, k, v = (torch.randn(batch, heads, length, d, device=device, dtype=dtype, requires_grad=requires_grad)
               for _ in range(3))
    mask = None
    if case.startswith("padding"):
        mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
        mask[..., int(length * 0.75):] = False
    elif case.startswith("padded"):
        kept = torch.linspace(0.10, 0.25, batch) if batch > 1 else torch.tensor([0.10])
        keys = torch.arange(length).view(1, 1, 1, -1)
        mask = (keys < (kept * length).long().clamp(min=1).view(-1, 1, 1, 1)).to(device)
    return q, k, v, mask


def oracle(q, k, v, mask, p, is_causal):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if is_causal:
        tril = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        mask = tril if mask is None else mask & tril
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    return F.dropout(scores.softmax(-1), p) @ v


def with_env(env, fn):
    """fn run with the environment variables in env set (fastmha reads its switches at every call)."""

    def run():
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value

    return run


def peer_fn(peer, q, k, v, mask, p, is_causal):
    if peer == "fastmha":
        return lambda: torch.ops.fastmha.attention(q, k, v, mask, p, False, is_causal)[0]
    if peer in SWITCHED:
        return with_env(SWITCHED[peer], lambda: torch.ops.fastmha.attention(q, k, v, mask, p, False, is_causal)[0])
    if peer == "fastmha_w":
        return lambda: torch.ops.fastmha.attention(q, k, v, mask, p, True, is_causal)[0]
    if peer == "oracle":
        return lambda: oracle(q, k, v, mask, p, is_causal)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)

    if peer == "sdpa":
        return sdpa

    def forced():
        with sdpa_kernel(SDPA_BACKENDS[peer]):
            return sdpa()

    return forced


def sdpa_default_backend(q, k, v, mask, p, is_causal):
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, mask, p, is_causal)).name
    except Exception as error:  # private API: report instead of failing the run
        return f"unknown ({type(error).__name__})"


class Clock:
    """CUDA events on the GPU, perf_counter elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin


def measure(fn, mode, clock, repeats, device):
    def step():
        if mode == "fwd":
            with torch.no_grad():
                fn()
        else:
            out = fn()
            out.backward(torch.ones_like(out))

    step()  # warm-up (and the error, if the peer refuses these inputs)
    times = [clock.time(step) for _ in range(repeats)]
    peak = float("nan")
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), peak


def flops(batch, heads, length, d, is_causal, mode):
    forward = 4 * batch * heads * length * length * d / (2 if is_causal else 1)
    return forward if mode == "fwd" else 3.5 * forward


def run(args, device, dtype, on_row):
    clock = Clock(device)
    rows = []
    for d in args.head_dims:
        for length in args.lengths:
            batch, heads = max(1, args.tokens // length), max(1, args.width // d)
            for case, (is_causal, p) in CASES.items():
                for mode in ("fwd", "fwd+bwd"):
                    row = dict(d=d, length=length, batch=batch, heads=heads, case=case, mode=mode, dtype=str(dtype))
                    q, k, v, mask = make_inputs(batch, heads, length, d, case, device, dtype, mode != "fwd")
                    row["sdpa_backend"] = sdpa_default_backend(q, k, v, mask, p, is_causal)
                    row["fastmha_kernel"] = fastmha.explain(q, k, v, mask, p, False, is_causal).splitlines()[0]
                    total = flops(batch, heads, length, d, is_causal, mode)
                    for peer in PEERS:
                        unchanged = peer == "fastmha_sdpa" and mask is None and p == 0  # the default's call
                        if unchanged or (peer in QUADRATIC_MEMORY and length > args.max_quadratic_length):
                            row[f"ms_{peer}"] = row[f"tflops_{peer}"] = row[f"mib_{peer}"] = float("nan")
                            continue
                        try:
                            seconds, mib = measure(peer_fn(peer, q, k, v, mask, p, is_causal), mode, clock,
                                                   args.repeats, device)
                        except (RuntimeError, torch.OutOfMemoryError) as error:
                            print(f"  {peer}: n/a ({str(error).splitlines()[0][:100]})")
                            seconds, mib = float("nan"), float("nan")
                            if device.type == "cuda":
                                torch.cuda.empty_cache()
                        row[f"ms_{peer}"] = seconds * 1e3
                        row[f"tflops_{peer}"] = total / seconds / 1e12 if seconds == seconds else float("nan")
                        row[f"mib_{peer}"] = mib
                    for peer in PEERS[1:]:
                        row[f"speedup_vs_{peer}"] = row[f"ms_{peer}"] / row["ms_fastmha"]
                    row["speedup_w_vs_oracle"] = row["ms_oracle"] / row["ms_fastmha_w"]
                    rows.append(row)
                    on_row(rows)
                    print(f"d{d} L{length} B{batch} H{heads} {case} {mode}: fastmha {row['tflops_fastmha']:.1f} "
                          f"TFLOP/s | vs sdpa({row['sdpa_backend']}) {row['speedup_vs_sdpa']:.2f}x | vs flash "
                          f"{row['speedup_vs_sdpa_flash']:.2f}x | vs efficient {row['speedup_vs_sdpa_efficient']:.2f}x"
                          f" | vs oracle {row['speedup_vs_oracle']:.2f}x", flush=True)
    return rows


def markdown(rows):
    lines = ["| d | L | case | mode | fastmha kernel | fastmha TFLOP/s | own TFLOP/s | mma / mma16 TFLOP/s "
             "| switched to sdpa TFLOP/s | sdpa (backend) | vs flash | vs efficient | vs cudnn | vs oracle "
             "| w vs oracle | MiB fastmha / w / oracle |",
             "|" + " --- |" * 16]
    for r in rows:
        lines.append(f"| {r['d']} | {r['length']} | {r['case']} | {r['mode']} | {r['fastmha_kernel']} | "
                     f"{r['tflops_fastmha']:.1f} | {r['tflops_fastmha_own']:.1f} | "
                     f"{r['tflops_fastmha_mma']:.1f} / {r['tflops_fastmha_mma16']:.1f} | "
                     f"{r['tflops_fastmha_sdpa']:.1f} | "
                     f"{r['speedup_vs_sdpa']:.2f}x ({r['sdpa_backend']}) | {r['speedup_vs_sdpa_flash']:.2f}x | "
                     f"{r['speedup_vs_sdpa_efficient']:.2f}x | {r['speedup_vs_sdpa_cudnn']:.2f}x | "
                     f"{r['speedup_vs_oracle']:.2f}x | {r['speedup_w_vs_oracle']:.2f}x | "
                     f"{r['mib_fastmha']:.0f} / {r['mib_fastmha_w']:.0f} / {r['mib_oracle']:.0f} |")
    return "\n".join(lines)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["d"], r["case"], r["mode"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
    for ax, (d, case, mode) in zip(axes[0], panels):
        sel = sorted((r for r in rows if (r["d"], r["case"], r["mode"]) == (d, case, mode)), key=lambda r: r["length"])
        for peer in PEERS:
            ax.plot([r["length"] for r in sel], [r[f"tflops_{peer}"] for r in sel], marker="o", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d{d} {case} {mode}", fontsize=8)
        ax.set_xlabel("L")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    parser.add_argument("--tokens", type=int, default=16384, help="B * L")
    parser.add_argument("--width", type=int, default=2048, help="H * d")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-quadratic-length", type=int, default=8192,
                        help="longest L for the peers that keep L x L weights")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the harness, measures nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.head_dims, args.tokens, args.width, args.repeats = [64, 128], [64], 256, 128, 2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "fastmha": fastmha.__version__,
            "build": fastmha.build_info, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "smoke": args.smoke}
    print(json.dumps(meta))
    stamp = f"{device.type}-{meta['date']}-{args.dtype}" + ("-smoke" if args.smoke else "")
    args.out.mkdir(parents=True, exist_ok=True)

    def save(rows):  # after every row, so that a run stopped at a time limit keeps the rows it measured
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        files = {"json": json.dumps({"meta": meta, "rows": rows}, indent=1), "csv": table.getvalue(),
                 "md": markdown(rows) + "\n"}
        for suffix, text in files.items():  # whole files only: written aside, then renamed
            path = args.out / f"{stamp}.{suffix}"
            path.with_suffix(".tmp").write_text(text)
            os.replace(path.with_suffix(".tmp"), path)

    rows = run(args, device, dtype, save)
    plot(rows, args.out / f"{stamp}.png", f"fastmha {meta['fastmha']} | torch {meta['torch']} | {meta['device']} | "
         f"{args.dtype} | {meta['date']}")
    print(markdown(rows))


if __name__ == "__main__":
    main()
