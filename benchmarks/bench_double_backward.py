"""A gradient-penalty step (double backward) and a plain training step: fastmha's block against the oracle block.

For each size, one round runs, interleaved, with the same weights and input x (B, L, d_model), float32, in
training with dropout --dropout (0.1), self-attention without a mask:
  penalty  out = block(x, x, x); g = grad(sum(out^2), x, create_graph=True); sum(g^2).backward()
  plain    out = block(x, x, x); sum(out^2).backward()
Medians over --repeats rounds; the ratio is oracle time / fastmha time (> 1: fastmha is faster). Also, interleaved,
the dropout multipliers of one step's weights (B, h, L, L): fastmha's replay from the forward's Philox state
(fastmha::_dropout_multipliers, which the second differentiation multiplies by) against torch drawing a mask as
nn.Dropout does (bernoulli_ then the 1/(1-p) scale). Results are stamped with the CPU model and ISA.

    python benchmarks/bench_double_backward.py --out benchmarks/results/cpu-double-backward-DATE
    python benchmarks/bench_double_backward.py --quick     # a smoke run (seconds)
"""

import sys
from pathlib import Path

import torch

import fastmha
from bench_common import interleaved_ms, markdown, start, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from oracle import OracleBlock  # noqa: E402

# (batch, length, d_model, heads): projection-bound, balanced, attention-bound.
SIZES = [(8, 64, 512, 8), (4, 256, 256, 4), (2, 1024, 512, 8)]
QUICK_SIZES = [(2, 16, 32, 4)]


def step(block, x, penalty):
    """A training step of self-attention on x: the loss sum(out^2), or with penalty the squared norm of its input
    gradient (taken with create_graph=True)."""
    inputs = x.clone().requires_grad_()
    out = block(inputs, inputs, inputs)
    loss = (out if isinstance(out, torch.Tensor) else out[0]).square().sum()
    if penalty:
        (grad,) = torch.autograd.grad(loss, inputs, create_graph=True)
        loss = grad.square().sum()
    loss.backward()


def measure(batch, length, d_model, heads, dropout_p, repeats):
    torch.manual_seed(0)
    block = fastmha.MultiHeadAttentionBlock(d_model, heads, dropout_p).train()
    oracle = OracleBlock(d_model, heads, dropout_p).train()
    oracle.load_state_dict(block.state_dict())
    x = torch.randn(batch, length, d_model)
    calls = {f"{kind}_{name}": (lambda m=m, penalty=kind == "penalty": step(m, x, penalty))
             for kind in ("penalty", "plain") for name, m in (("fastmha", block), ("oracle", oracle))}
    sizes, rng_state = [batch, heads, length, length], torch.tensor([1234, 0])
    calls["replay_fastmha"] = lambda: torch.ops.fastmha._dropout_multipliers(sizes, dropout_p, torch.float32, rng_state)
    calls["replay_bernoulli"] = lambda: torch.empty(sizes).bernoulli_(1 - dropout_p).div_(1 - dropout_p)
    raw = interleaved_ms(calls, repeats)
    ms = {name: round(t, 3 if name.startswith("replay") else 1) for name, t in raw.items()}
    return {"batch": batch, "length": length, "d_model": d_model, "heads": heads, "dropout": dropout_p, "ms": ms,
            "penalty_ratio": round(ms["penalty_oracle"] / ms["penalty_fastmha"], 2),
            "plain_ratio": round(ms["plain_oracle"] / ms["plain_fastmha"], 2),
            "replay_ratio": round(raw["replay_bernoulli"] / raw["replay_fastmha"], 2)}


COLUMNS = {"B": lambda r: r["batch"], "L": lambda r: r["length"], "d_model": lambda r: r["d_model"],
           "h": lambda r: r["heads"], "penalty fastmha ms": lambda r: r["ms"]["penalty_fastmha"],
           "penalty oracle ms": lambda r: r["ms"]["penalty_oracle"], "penalty ratio": lambda r: r["penalty_ratio"],
           "plain fastmha ms": lambda r: r["ms"]["plain_fastmha"], "plain oracle ms": lambda r: r["ms"]["plain_oracle"],
           "plain ratio": lambda r: r["plain_ratio"], "replay fastmha ms": lambda r: r["ms"]["replay_fastmha"],
           "bernoulli mask ms": lambda r: r["ms"]["replay_bernoulli"], "replay ratio": lambda r: r["replay_ratio"]}


def main():
    args, repeats, header = start(__doc__, 7, lambda parser: parser.add_argument("--dropout", type=float, default=0.1))
    rows = []
    for size in QUICK_SIZES if args.quick else SIZES:
        row = measure(*size, args.dropout, repeats)
        rows.append(row)
        print(f"B{size[0]} L{size[1]} d{size[2]} h{size[3]}  penalty {row['ms']['penalty_fastmha']} vs "
              f"{row['ms']['penalty_oracle']} ms ({row['penalty_ratio']}x)  plain {row['ms']['plain_fastmha']} vs "
              f"{row['ms']['plain_oracle']} ms ({row['plain_ratio']}x)  replay {row['ms']['replay_fastmha']} vs "
              f"{row['ms']['replay_bernoulli']} ms ({row['replay_ratio']}x)", flush=True)
    if args.out:
        setup = (f"float32, training, dropout {args.dropout}, self-attention without a mask, interleaved, medians of "
                 f"{repeats}; ratio = oracle / fastmha. Replay: the dropout multipliers of (B, h, L, L) weights, "
                 "fastmha's replay against torch's bernoulli_ mask and scale; ratio = bernoulli / replay.")
        page = markdown("# Gradient penalty (double backward) and plain training step: fastmha against the oracle "
                        "block", header, setup, COLUMNS, rows)
        write_results(args.out, header, rows, page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
