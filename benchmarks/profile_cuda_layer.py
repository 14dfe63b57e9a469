"""Where a call through fastmha's CUDA layer spends its time, next to SDPA on the same call.

bench_cuda.py times one forward + backward between CUDA events and waits for it, so a step pays whatever the host
takes to issue its kernels while the GPU waits. This script separates that from the GPU's own work, for each case
(bfloat16 (B, H, L, d) with B = tokens / L and H = width / d, as bench_cuda.py) and each peer (fastmha's default,
`fastmha`; the default with FASTMHA_CUDA_MASKED=sdpa for masked cases, `fastmha_sdpa`; and
F.scaled_dot_product_attention as torch picks its backend, `sdpa`), forward + backward:

  step ms     one step between CUDA events, waited for (bench_cuda.py's clock)
  stream ms   per step of --chain steps issued back to back and waited for once: the GPU's time when the host
              keeps ahead of it
  host ms     per step of that chain, the host's time to issue it (before the wait)
  kernels     the device's kernels per step under torch.profiler, by time (none on the CPU)
  host ops    the host's ATen ops per step by self time: where a slower issue goes

A peer whose step ms exceeds its stream ms waits for its host; one whose stream ms exceeds SDPA's runs more or
slower kernels (the kernels table says which).

    python benchmarks/profile_cuda_layer.py --out DIR                      # on a GPU, about a minute
    python benchmarks/profile_cuda_layer.py --smoke --device cpu --out DIR  # the harness on tiny shapes
"""

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fastmha
from bench_cuda import with_env

# name: (is_causal, mask: None or "padding", the last quarter of the keys padded)
CASES = {"none": (False, None), "causal": (True, None), "padding": (False, "padding")}


def make_inputs(batch, heads, length, d, mask_kind, device, dtype):
    q, k, v = (torch.randn(batch, heads, length, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = None
    if mask_kind == "padding":
        mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
        mask[..., int(length * 0.75):] = False
    return q, k, v, mask


def peer_step(peer, q, k, v, mask, is_causal):
    """One forward + backward, as bench_cuda.py's fwd+bwd step."""
    def forward():
        if peer == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return torch.ops.fastmha.attention(q, k, v, mask, 0.0, False, is_causal)[0]

    def step():
        out = forward()
        out.backward(torch.ones_like(out))

    return with_env({"FASTMHA_CUDA_MASKED": "sdpa"} if peer == "fastmha_sdpa" else {}, step)


def wait(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(step, device, repeats):
    """bench_cuda.py's clock: one step between events, waited for."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def chain_ms(step, device, chain, repeats):
    """Per step of `chain` steps issued back to back: (device time with one wait, host time to issue them)."""
    stream, host = [], []
    for _ in range(repeats):
        wait(device)
        begin = time.perf_counter()
        for _ in range(chain):
            step()
        issued = time.perf_counter()
        wait(device)
        done = time.perf_counter()
        stream.append((done - begin) * 1e3 / chain)
        host.append((issued - begin) * 1e3 / chain)
    return statistics.median(stream), statistics.median(host)


def event_us(event, field):
    """An event's self time in microseconds under the names torch has used for it."""
    names = {"device": ("self_device_time_total", "self_cuda_time_total"), "cpu": ("self_cpu_time_total",)}[field]
    for name in names:
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profiled(step, device, steps, top):
    """The device's kernels and the host's ops per step, by self time (microseconds), the largest `top` each."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        wait(device)
    events = prof.key_averages()
    on_device = device.type == "cuda"
    kernels, host = [], []
    for event in events:
        device_us = event_us(event, "device")
        is_kernel = on_device and getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA
        if is_kernel or (on_device and device_us > 0 and event_us(event, "cpu") == 0):
            kernels.append((event.key, device_us / steps, event.count / steps))
        elif event_us(event, "cpu") > 0:
            host.append((event.key, event_us(event, "cpu") / steps, event.count / steps))
    by_time = lambda rows: sorted(rows, key=lambda r: -r[1])[:top]  # noqa: E731
    return by_time(kernels), by_time(host)


def run(args, device, dtype):
    rows = []
    for d in args.head_dims:
        for length in args.lengths:
            batch, heads = max(1, args.tokens // length), max(1, args.width // d)
            for case in args.cases:
                is_causal, mask_kind = CASES[case]
                q, k, v, mask = make_inputs(batch, heads, length, d, mask_kind, device, dtype)
                peers = ["fastmha", "sdpa"] + (["fastmha_sdpa"] if mask is not None else [])
                for peer in peers:
                    row = dict(d=d, length=length, batch=batch, heads=heads, case=case, peer=peer)
                    step = peer_step(peer, q, k, v, mask, is_causal)
                    try:
                        for _ in range(3):  # warm-up: cuDNN's graphs, the allocator, the choice's caches
                            step()
                        wait(device)
                        row["step_ms"] = step_ms(step, device, args.repeats)
                        row["stream_ms"], row["host_ms"] = chain_ms(step, device, args.chain, args.repeats)
                        row["kernels"], row["host_ops"] = profiled(step, device, args.profile_steps, args.top)
                    except (RuntimeError, torch.OutOfMemoryError) as error:
                        row["error"] = str(error).splitlines()[0][:160]
                    if peer != "sdpa":
                        line = fastmha.explain(q, k, v, mask, 0.0, False, is_causal).splitlines()
                        row["kernel"] = " | ".join(line[:2])
                    rows.append(row)
                    timing = row.get("error") or (f"step {row['step_ms']:.3f} ms, stream {row['stream_ms']:.3f} ms, "
                                                  f"host {row['host_ms']:.3f} ms")
                    print(f"d{d} L{length} {case} {peer}: {timing}", flush=True)
                q = k = v = mask = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def markdown(meta, rows):
    lines = ["# fastmha's CUDA layer against SDPA, forward + backward: where the time goes", "",
             f"- date {meta['date']} | device {meta['device']} | torch {meta['torch']} | fastmha {meta['fastmha']}"
             f" | {meta['dtype']}", "- columns: see `benchmarks/profile_cuda_layer.py`", "",
             "| d | L (B x H) | case | peer | step ms | stream ms | host ms | kernel (fastmha.explain) |",
             "|" + " --- |" * 8]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['d']} | {r['length']} | {r['case']} | {r['peer']} | n/a: {r['error']} | | | |")
            continue
        lines.append(f"| {r['d']} | {r['length']} ({r['batch']} x {r['heads']}) | {r['case']} | {r['peer']} | "
                     f"{r['step_ms']:.3f} | {r['stream_ms']:.3f} | {r['host_ms']:.3f} | {r.get('kernel', '')} |")
    for r in rows:
        if "error" in r:
            continue
        lines += ["", f"## d {r['d']}, L {r['length']}, {r['case']}, {r['peer']}"]
        if r["kernels"]:
            lines += ["", "| kernel (device) | us per step | calls per step |", "| --- | --- | --- |"]
            lines += [f"| `{name[:110]}` | {us:.1f} | {calls:.1f} |" for name, us, calls in r["kernels"]]
        lines += ["", "| host op | self us per step | calls per step |", "| --- | --- | --- |"]
        lines += [f"| `{name[:110]}` | {us:.1f} | {calls:.1f} |" for name, us, calls in r["host_ops"]]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    as_ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=as_ints, default=[1024, 4096])
    parser.add_argument("--head-dims", type=as_ints, default=[64])
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES))
    parser.add_argument("--tokens", type=int, default=16384, help="B * L")
    parser.add_argument("--width", type=int, default=2048, help="H * d")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chain", type=int, default=10, help="steps issued back to back for stream and host ms")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="rows of each profile table")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the harness, measures nothing")
    parser.add_argument("--out", type=Path, required=True, help="a folder for the .md and .json")
    args = parser.parse_args()
    if args.smoke:
        args.lengths, args.tokens, args.width, args.repeats, args.chain, args.profile_steps = [64], 128, 64, 2, 2, 1
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; known: {','.join(CASES)}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "fastmha": fastmha.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": args.dtype,
            "smoke": args.smoke}
    rows = run(args, device, dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"profile-{device.type}-{meta['date']}-{args.dtype}{'-smoke' if args.smoke else ''}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
