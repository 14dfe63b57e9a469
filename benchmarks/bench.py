"""fastmha benchmark: the attention block against its peers, measured in one run, interleaved.

Peers (same weights, same inputs):
  oracle       eager block written from the textbook math (tests/python/oracle.py) + F.dropout on the weights
  sdpa         the same Linear layers around F.scaled_dot_product_attention
  mha_w/mha_nw torch.nn.MultiheadAttention(bias=False, batch_first=True), need_weights True / False
  fastmha_w    fastmha.MultiHeadAttentionBlock, weights kept (the drop-in default)
  fastmha_nw   fastmha.MultiHeadAttentionBlock(need_weights=False)
  bound        the same four projections around an attention core that costs nothing: no block that computes
               every projection row can beat its time, and oracle / bound is the most such a block could speed
               the oracle up (fastmha's skips the rows of keys that a mask hides from every query)

Each configuration runs every peer once per round, for --repeats rounds (interleaved, so drift hits all
peers alike), and reports medians, ratios (peer time / fastmha time: > 1 means fastmha is faster), GFLOP/s,
the same-shape GEMMs alone ("gemm": the physical limit; efficiency = t_gemm / t_fastmha_nw) and, with
--memory, the peak memory of each peer in a fresh process.

    python benchmarks/bench.py                # the default matrix (about 10 min on 2 cores)
    python benchmarks/bench.py --quick        # a smoke run (seconds)
    python benchmarks/bench.py --full         # the whole matrix (hours on 2 cores)
"""

import argparse
import csv
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fastmha
from fastmha.info import cpu_lines

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from oracle import OracleBlock  # noqa: E402

PEERS = ["oracle", "sdpa", "mha_w", "mha_nw", "fastmha_w", "fastmha_nw", "bound"]


@dataclass(frozen=True)
class Config:
    d_model: int
    heads: int
    length: int
    batch: int
    mode: str  # "fwd" (no_grad) or "fwd+bwd"
    dropout: float
    mask: str  # "none", "padding" (25% of keys), "causal-mask", "is_causal"
    dtype: str

    @property
    def name(self):
        return (f"D{self.d_model}/h{self.heads} L{self.length} B{self.batch} {self.mode} p{self.dropout} "
                f"{self.mask} {self.dtype}")


class EagerBlock(OracleBlock):
    """The oracle block with dropout on the weights, as the textbook block does in training."""

    def __init__(self, d_model, heads, dropout):
        super().__init__(d_model, heads)
        self.p = dropout

    def forward(self, q, k, v, mask=None):  # type: ignore[override]
        scores = self.split(self.w_q(q)) @ self.split(self.w_k(k)).transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        weights = F.dropout(scores.softmax(-1), self.p, self.training)
        out = weights @ self.split(self.w_v(v))
        b, _, length, _ = out.shape
        return self.w_o(out.permute(0, 2, 1, 3).reshape(b, length, self.h * self.d_k))


class ZeroCostCoreBlock(EagerBlock):
    """The block's projections with no attention core (the projected query, key and value are mixed in
    O(L * d_model), so every projection still gets its gradient): a lower bound of any attention block's time."""

    def forward(self, q, k, v, mask=None):  # type: ignore[override]
        keys = self.w_k(k).mean(1, keepdim=True) + self.w_v(v).mean(1, keepdim=True)
        return self.w_o(self.w_q(q) + keys)


class SdpaBlock(OracleBlock):
    def __init__(self, d_model, heads, dropout, is_causal):
        super().__init__(d_model, heads)
        self.p, self.is_causal = dropout, is_causal

    def forward(self, q, k, v, mask=None):  # type: ignore[override]
        attn_mask = None if mask is None else mask != 0
        out = F.scaled_dot_product_attention(self.split(self.w_q(q)), self.split(self.w_k(k)),
                                             self.split(self.w_v(v)), attn_mask=attn_mask,
                                             dropout_p=self.p if self.training else 0.0, is_causal=self.is_causal)
        b, _, length, _ = out.shape
        return self.w_o(out.permute(0, 2, 1, 3).reshape(b, length, self.h * self.d_k))


class TorchMha(nn.Module):
    def __init__(self, d_model, heads, dropout, need_weights, is_causal):
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, heads, dropout=dropout, bias=False, batch_first=True)
        self.need_weights, self.is_causal = need_weights, is_causal

    def load_from(self, block):
        with torch.no_grad():
            self.mha.in_proj_weight.copy_(torch.cat([block.w_q.weight, block.w_k.weight, block.w_v.weight]))
            self.mha.out_proj.weight.copy_(block.w_o.weight)

    def forward(self, q, k, v, padding=None, causal=None):
        out, _ = self.mha(q, k, v, key_padding_mask=padding, attn_mask=causal, need_weights=self.need_weights,
                          average_attn_weights=False, is_causal=self.is_causal and causal is not None)
        return out


def make_inputs(cfg, device, dtype):
    x = torch.randn(cfg.batch, cfg.length, cfg.d_model, device=device, dtype=dtype)
    masks = {"mask": None, "padding": None, "causal": None}
    if cfg.mask == "padding":
        keep = torch.ones(cfg.batch, cfg.length, dtype=torch.bool, device=device)
        keep[:, int(cfg.length * 0.75):] = False
        masks["mask"] = keep[:, None, None, :]
        masks["padding"] = ~keep  # nn.MultiheadAttention: True = ignore
    elif cfg.mask in ("causal-mask", "is_causal"):
        tril = torch.tril(torch.ones(cfg.length, cfg.length, dtype=torch.bool, device=device))
        masks["mask"] = tril if cfg.mask == "causal-mask" else None
        masks["causal"] = ~tril
    return x, masks


def make_peers(cfg, device, dtype):
    is_causal = cfg.mask == "is_causal"
    ours_w = fastmha.MultiHeadAttentionBlock(cfg.d_model, cfg.heads, cfg.dropout, is_causal=is_causal)
    ours_nw = fastmha.MultiHeadAttentionBlock(cfg.d_model, cfg.heads, cfg.dropout, need_weights=False,
                                              is_causal=is_causal)
    ours_nw.load_state_dict(ours_w.state_dict())
    eager = EagerBlock(cfg.d_model, cfg.heads, cfg.dropout)
    sdpa = SdpaBlock(cfg.d_model, cfg.heads, cfg.dropout, is_causal)
    bound = ZeroCostCoreBlock(cfg.d_model, cfg.heads, cfg.dropout)
    for block in (eager, sdpa, bound):
        block.load_state_dict(ours_w.state_dict())
    mha_w = TorchMha(cfg.d_model, cfg.heads, cfg.dropout, True, is_causal)
    mha_nw = TorchMha(cfg.d_model, cfg.heads, cfg.dropout, False, is_causal)
    for mha in (mha_w, mha_nw):
        mha.load_from(ours_w)
    peers = {"oracle": eager, "sdpa": sdpa, "mha_w": mha_w, "mha_nw": mha_nw, "fastmha_w": ours_w,
             "fastmha_nw": ours_nw, "bound": bound}
    for module in peers.values():
        module.to(device, dtype).train(cfg.dropout > 0)
    return peers


def peer_call(name, module, x, masks, cfg):
    if name.startswith("mha"):
        # is_causal: nn.MultiheadAttention needs the mask tensor as a hint anyway.
        causal = masks["causal"] if cfg.mask in ("causal-mask", "is_causal") else None
        return lambda: module(x, x, x, masks["padding"], causal)
    if name == "oracle" and cfg.mask == "is_causal":  # the textbook block has no is_causal: give it the mask
        tril = ~masks["causal"]
        return lambda: module(x, x, x, tril)
    return lambda: module(x, x, x, masks["mask"])


def timed(fn, mode, device, x):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if mode == "fwd":
        with torch.no_grad():
            fn()
    else:
        x.grad = None
        fn().float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def gemm_time(cfg, device, dtype, repeats):
    """The same-shape GEMMs alone: projections, Q K^T and P V (and their backward counterparts)."""
    b, length, d, h = cfg.batch, cfg.length, cfg.d_model, cfg.heads
    x = torch.randn(b * length, d, device=device, dtype=dtype)
    w = torch.randn(d, d, device=device, dtype=dtype)
    q = torch.randn(b, h, length, d // h, device=device, dtype=dtype)
    s = torch.empty(b, h, length, length, device=device, dtype=dtype)
    passes = 1 if cfg.mode == "fwd" else 3  # backward: two GEMMs per forward GEMM

    def run():
        for _ in range(passes):
            for _ in range(4):
                torch.mm(x, w)
            torch.matmul(q, q.transpose(-2, -1), out=s)
            torch.matmul(s, q)
        if device.type == "cuda":
            torch.cuda.synchronize()

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def flops(cfg):
    b, length, d = cfg.batch, cfg.length, cfg.d_model
    fwd = 8 * b * length * d * d + 4 * b * length * length * d
    return fwd if cfg.mode == "fwd" else 24 * b * length * d * d + 14 * b * length * length * d


def sdpa_backend(cfg, device, dtype):
    q = torch.randn(cfg.batch, cfg.heads, cfg.length, cfg.d_model // cfg.heads, device=device, dtype=dtype)
    mask = None if cfg.mask in ("none", "is_causal") else torch.ones(1, 1, cfg.length, cfg.length, device=device,
                                                                     dtype=torch.bool)
    try:
        choice = torch._fused_sdp_choice(q, q, q, mask, cfg.dropout, cfg.mask == "is_causal")
        return torch.nn.attention.SDPBackend(choice).name
    except Exception as error:  # private API: report instead of failing the run
        return f"unknown ({type(error).__name__})"


def run_config(cfg, device, repeats):
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(0)
    peers = make_peers(cfg, device, dtype)
    x, masks = make_inputs(cfg, device, dtype)
    x.requires_grad_(cfg.mode != "fwd")
    calls = {name: peer_call(name, module, x, masks, cfg) for name, module in peers.items()}
    for name, fn in calls.items():  # warm-up
        timed(fn, cfg.mode, device, x)
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(timed(fn, cfg.mode, device, x))
    medians = {name: statistics.median(t) for name, t in times.items()}
    row = asdict(cfg)
    row.update({f"t_{name}_ms": medians[name] * 1e3 for name in PEERS})
    ours = medians["fastmha_nw"]
    row.update({f"speedup_nw_vs_{name}": medians[name] / ours for name in PEERS if name != "fastmha_nw"})
    row["speedup_w_vs_oracle"] = medians["oracle"] / medians["fastmha_w"]
    row["speedup_w_vs_mha_w"] = medians["mha_w"] / medians["fastmha_w"]
    row["speedup_bound_vs_oracle"] = medians["oracle"] / medians["bound"]
    row["gflops_fastmha_nw"] = flops(cfg) / ours / 1e9
    row["gflops_sdpa"] = flops(cfg) / medians["sdpa"] / 1e9
    t_gemm = gemm_time(cfg, device, dtype, max(3, repeats // 2))
    row["t_gemm_ms"] = t_gemm * 1e3
    row["gemm_efficiency_nw"] = t_gemm / ours
    row["sdpa_backend"] = sdpa_backend(cfg, device, dtype)
    return row


def peak_memory(cfg, peer, device):
    """Peak memory of one peer's call in a fresh process (RSS on CPU, allocator peak on CUDA), in MiB."""
    code = (f"import sys; sys.argv=['bench']; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"import bench; print(bench.probe_memory({json.dumps(asdict(cfg))!r}, {peer!r}, {device.type!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        return float("nan")
    return float(result.stdout.strip().splitlines()[-1])


def probe_memory(cfg_json, peer, device_type):
    cfg = Config(**json.loads(cfg_json))
    device = torch.device(device_type)
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(0)
    module = make_peers(cfg, device, dtype)[peer]
    x, masks = make_inputs(cfg, device, dtype)
    x.requires_grad_(cfg.mode != "fwd")
    fn = peer_call(peer, module, x, masks, cfg)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        timed(fn, cfg.mode, device, x)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    # Peak RSS of the call alone: reset the kernel's high-water mark (a fork/exec child inherits the parent's)
    # and read it back; the difference from the RSS before the call is what the call added.
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    base = _status_kib("VmRSS")
    timed(fn, cfg.mode, device, x)
    return (_status_kib("VmHWM") - base) / 1024


def _status_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def matrix(args):
    shapes = [(512, 8), (1024, 16), (1024, 8)] if args.full else [(512, 8)]
    lengths = args.lengths or ([128, 256, 512, 1024, 2048, 4096] if args.full else [128, 512, 1024, 2048, 4096])
    dtypes = args.dtypes
    if args.quick:
        return [Config(512, 8, 256, 4096 // 256, mode, p, mask, dtypes[0])
                for mode, p, mask in [("fwd", 0.0, "none"), ("fwd+bwd", 0.1, "padding"), ("fwd+bwd", 0.0, "is_causal")]]
    configs = []
    for (d, h), length, dtype in itertools.product(shapes, lengths, dtypes):
        batch = max(1, 4096 // length)
        combos = [("fwd", 0.0, "none"), ("fwd+bwd", 0.0, "none"), ("fwd+bwd", 0.1, "none"),
                  ("fwd+bwd", 0.0, "padding"), ("fwd", 0.0, "is_causal")]
        if args.full:
            combos = list(itertools.product(["fwd", "fwd+bwd"], [0.0, 0.1],
                                            ["none", "padding", "causal-mask", "is_causal"]))
        configs += [Config(d, h, length, batch, mode, p, mask, dtype) for mode, p, mask in combos]
    return configs


def write_results(rows, out_dir, stamp, meta):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    fields = list(dict.fromkeys(key for row in rows for key in row))  # memory columns exist on some rows only
    csv_path = out_dir / f"{stamp}.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return csv_path


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("fwd", 0.0, "none"), ("fwd+bwd", 0.0, "none"), ("fwd+bwd", 0.1, "none"), ("fwd+bwd", 0.0, "padding")]
    panels = [p for p in panels if any((r["mode"], r["dropout"], r["mask"]) == p for r in rows)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (mode, p, mask) in zip(axes[0], panels):
        sel = [r for r in rows if (r["mode"], r["dropout"], r["mask"]) == (mode, p, mask) and r["d_model"] == 512]
        sel.sort(key=lambda r: r["length"])
        for peer in PEERS:
            ax.plot([r["length"] for r in sel], [r[f"t_{peer}_ms"] for r in sel], marker="o", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{mode}, dropout {p}, mask {mask}", fontsize=9)
        ax.set_xlabel("L (batch = 4096 / L)")
        ax.set_ylabel("median ms")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown_table(rows):
    lines = ["| config | fastmha_nw ms | vs sdpa | vs mha_nw | vs oracle | fastmha_w vs oracle | bound vs oracle | GEMM eff. "
             "| sdpa kernel |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| L{r['length']} B{r['batch']} {r['mode']} p{r['dropout']} {r['mask']} {r['dtype']} | "
                     f"{r['t_fastmha_nw_ms']:.1f} | {r['speedup_nw_vs_sdpa']:.2f}x | {r['speedup_nw_vs_mha_nw']:.2f}x | "
                     f"{r['speedup_nw_vs_oracle']:.2f}x | {r['speedup_w_vs_oracle']:.2f}x | "
                     f"{r['speedup_bound_vs_oracle']:.2f}x | "
                     f"{r['gemm_efficiency_nw']:.2f} | {r['sdpa_backend']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32", type=lambda s: s.split(","))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="sequence lengths to run (default: the matrix's)")
    parser.add_argument("--tag", default="", help="suffix for the result file names")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--memory", action="store_true",
                        help="also peak memory per peer (a fresh process each) for fwd+bwd rows with L >= 2048")
    parser.add_argument("--memory-only", action="store_true", help="only the peak memory rows, no timings")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "fastmha": fastmha.__version__,
            "threads": torch.get_num_threads(), "device": args.device, "cpu_kernels": fastmha._C.cpu_capability(),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "cpu": cpu_lines()}
    print(json.dumps(meta))
    rows = []
    if args.memory_only:
        for cfg in matrix(args):
            if cfg.length >= 2048 and cfg.mode == "fwd+bwd":
                row = asdict(cfg)
                row.update({f"peak_mib_{peer}": peak_memory(cfg, peer, device) for peer in PEERS})
                rows.append(row)
                print(json.dumps(row), flush=True)
        write_results(rows, args.out, f"{args.device}-{meta['date']}-memory", meta)
        return
    for cfg in matrix(args):
        row = run_config(cfg, device, 3 if args.quick else args.repeats)
        if args.memory and cfg.length >= 2048 and cfg.mode == "fwd+bwd":
            for peer in PEERS:
                row[f"peak_mib_{peer}"] = peak_memory(cfg, peer, device)
        rows.append(row)
        print(f"{cfg.name}: fastmha_nw {row['t_fastmha_nw_ms']:.1f} ms | vs sdpa {row['speedup_nw_vs_sdpa']:.2f}x | "
              f"vs oracle {row['speedup_nw_vs_oracle']:.2f}x | w vs oracle {row['speedup_w_vs_oracle']:.2f}x | "
              f"gemm eff {row['gemm_efficiency_nw']:.2f} | sdpa={row['sdpa_backend']}", flush=True)
    stamp = f"{args.device}-{meta['date']}" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    csv_path = write_results(rows, args.out, stamp, meta)
    plot(rows, args.out / f"{stamp}.png", f"fastmha {meta['fastmha']} | torch {meta['torch']} | {args.device} "
         f"{meta['cpu_kernels']} | {meta['threads']} threads | {meta['date']}")
    stamp_lines = [f"- fastmha {meta['fastmha']} | torch {meta['torch']} | {meta['threads']} threads | {meta['date']}",
                   *(f"- {line}" for line in meta["cpu"])]
    (args.out / f"{stamp}.md").write_text("\n".join(stamp_lines) + "\n\n" + markdown_table(rows) + "\n")
    print(f"\nwrote {csv_path} (+ .json, .png, .md)\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
