"""The block under torch.compile: a training step and an inference forward, eager and compiled, fastmha's block
against the oracle block (same weights).

For each length L, x (B, L, d_model) float32, self-attention with a padding mask (the last quarter of the keys of
every sequence masked), B * L = --tokens:
  train  .train(), dropout --dropout: out = block(x, x, x, mask); sum(out^2).backward()
  infer  .eval(), under torch.inference_mode(): block(x, x, x, mask)
Peers: the oracle block (it returns its weights, as the textbook class keeps them in attention_scores), fastmha's
block keeping its weights (the drop-in) and not keeping them (need_weights=False), each eager and under
torch.compile (inductor, default mode; compiled before timing). Medians of --repeats interleaved rounds; ratios
are oracle time / fastmha time in the same mode (compiled against compiled), and fastmha's eager time / its
compiled time. Results are stamped with the CPU model and ISA.

    python benchmarks/bench_compile.py --out benchmarks/results/cpu-compile-DATE
    python benchmarks/bench_compile.py --quick     # a smoke run
"""

import sys
from pathlib import Path

import torch

import fastmha
from bench_common import interleaved_ms, markdown, start, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from oracle import OracleBlock  # noqa: E402

LENGTHS = [128, 512, 1024]
PEERS = ("oracle", "kept", "not_kept")


def call(block, x, mask, task):
    """One training step or inference forward of block on x."""
    if task == "infer":
        with torch.inference_mode():
            block(x, x, x, mask)
        return
    inputs = x.clone().requires_grad_()
    out = block(inputs, inputs, inputs, mask)
    (out if isinstance(out, torch.Tensor) else out[0]).square().sum().backward()


def measure(task, length, tokens, d_model, heads, dropout_p, repeats):
    torch.manual_seed(0)
    blocks = {"kept": fastmha.MultiHeadAttentionBlock(d_model, heads, dropout_p),
              "not_kept": fastmha.MultiHeadAttentionBlock(d_model, heads, dropout_p, need_weights=False),
              "oracle": OracleBlock(d_model, heads, dropout_p)}
    for block in blocks.values():
        block.load_state_dict(blocks["kept"].state_dict())
        block.train(task == "train")
    batch = max(1, tokens // length)
    x = torch.randn(batch, length, d_model)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.int64)
    mask[..., length - length // 4:] = 0
    calls = {}
    for name in PEERS:
        compiled = torch.compile(blocks[name])
        call(compiled, x, mask, task)  # compiles outside the timed rounds
        calls[f"{name}_eager"] = lambda b=blocks[name]: call(b, x, mask, task)
        calls[f"{name}_compiled"] = lambda b=compiled: call(b, x, mask, task)
    ms = {name: round(t, 2) for name, t in interleaved_ms(calls, repeats).items()}
    ratios = {f"{mode}_{name}": round(ms[f"oracle_{mode}"] / ms[f"{name}_{mode}"], 2)
              for mode in ("eager", "compiled") for name in ("kept", "not_kept")}
    ratios.update({f"compile_gain_{name}": round(ms[f"{name}_eager"] / ms[f"{name}_compiled"], 2) for name in PEERS})
    return {"task": task, "batch": batch, "length": length, "d_model": d_model, "heads": heads,
            "dropout": dropout_p if task == "train" else 0.0, "ms": ms, "ratios": ratios}


COLUMNS = {"task": lambda r: r["task"], "B": lambda r: r["batch"], "L": lambda r: r["length"]}
COLUMNS.update({f"{name} {mode} ms": (lambda r, k=f"{name}_{mode}": r["ms"][k])
                for name in PEERS for mode in ("eager", "compiled")})
COLUMNS.update({
    "compiled: oracle / kept": lambda r: r["ratios"]["compiled_kept"],
    "compiled: oracle / not kept": lambda r: r["ratios"]["compiled_not_kept"],
    "eager: oracle / kept": lambda r: r["ratios"]["eager_kept"],
    "eager: oracle / not kept": lambda r: r["ratios"]["eager_not_kept"],
    "kept eager / compiled": lambda r: r["ratios"]["compile_gain_kept"],
    "not kept eager / compiled": lambda r: r["ratios"]["compile_gain_not_kept"],
    "oracle eager / compiled": lambda r: r["ratios"]["compile_gain_oracle"],
})


def add_arguments(parser):
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--tokens", type=int, default=4096, help="batch x length of every size")


def main():
    args, repeats, header = start(__doc__, 5, add_arguments)
    # Every (block, length, task) compiles its own graph: more than dynamo's default cache holds per function.
    torch._dynamo.config.cache_size_limit = 64
    lengths, tokens, d_model, heads = ([16], 32, 32, 4) if args.quick else (LENGTHS, args.tokens, 512, 8)
    rows = []
    for task in ("train", "infer"):
        for length in lengths:
            row = measure(task, length, tokens, d_model, heads, args.dropout, repeats)
            rows.append(row)
            print(f"{task} B{row['batch']} L{length}  " + "  ".join(f"{k} {v}" for k, v in row["ms"].items())
                  + "  |  " + "  ".join(f"{k} {v}x" for k, v in row["ratios"].items()), flush=True)
    if args.out:
        setup = (f"float32, d_model {d_model}, {heads} heads, self-attention, the last quarter of the keys padded; "
                 f"train: dropout {args.dropout}, forward + backward; infer: eval, inference_mode; torch.compile "
                 f"default (inductor); interleaved, medians of {repeats}; ratios oracle / fastmha in the same mode.")
        page = markdown("# The block under torch.compile: fastmha against the oracle block, eager and compiled",
                        header, setup, COLUMNS, rows)
        write_results(args.out, header, rows, page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
