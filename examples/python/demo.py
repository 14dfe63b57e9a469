"""fastmha demo: train a small Transformer translator whose attention blocks are fastmha's, next to the same
model built on the oracle block (plain PyTorch from the formulas), from the same initial weights and data.

The task needs no download: translate a digit string into its reverse (cross-attention has to learn the
alignment). The demo prints both step times and the speed-up, shows that both loss curves agree within
noise, decodes a few examples, draws the attention weights and the loss curves, saves the trained model as
TorchScript, and runs the C++ `translate` example on it, checking that C++ and Python agree.

    python examples/python/demo.py [--steps N] [--device cpu|cuda] [--dtype float32|bfloat16|float64] [--out DIR]
"""

import argparse
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import fastmha

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import OracleBlock  # noqa: E402
from transformer import EOS, PAD, Seq2Seq, digits_to_tokens, make_batch, tokens_to_digits  # noqa: E402

EXAMPLES = ["31415", "2718281", "1234567890", "9081726354", "555"]


class OracleAttention(OracleBlock):
    """The oracle block with the drop-in's call signature; keeps its weights for inspection."""

    def forward(self, q, k, v, mask=None):  # type: ignore[override]
        out, self.attention_scores = super().forward(q, k, v, mask)
        return out


def train(model, args, device, label):
    torch.manual_seed(1)  # the same dropout stream start for both runs (each block draws differently)
    generator = torch.Generator().manual_seed(2)  # the same batches for both models
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD)
    model.train()
    losses, accuracies, times = [], [], []
    bar = tqdm(range(args.steps), desc=f"{label:>7}", ncols=100, mininterval=0.5)
    for _ in bar:
        src, tgt_in, tgt_out = (t.to(device) for t in make_batch(args.batch, 3, args.max_len, generator))
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(src, tgt_in)
        loss = loss_fn(logits.float().reshape(-1, logits.size(-1)), tgt_out.reshape(-1))
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        keep = tgt_out != PAD
        accuracy = ((logits.argmax(-1) == tgt_out) & keep).sum().item() / keep.sum().item()
        losses.append(loss.item())
        accuracies.append(accuracy)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{accuracy:.2f}")
    step_time = sorted(times)[len(times) // 2]
    return losses, accuracies, step_time


def evaluate(model, device, args):
    generator = torch.Generator().manual_seed(99)
    src, tgt_in, tgt_out = (t.to(device) for t in make_batch(512, 3, args.max_len, generator))
    model.eval()
    with torch.no_grad():
        logits = model(src, tgt_in)
    keep = tgt_out != PAD
    return ((logits.argmax(-1) == tgt_out) & keep).sum().item() / keep.sum().item()


def encode_examples(device, max_len):
    src = torch.full((len(EXAMPLES), max_len), PAD, dtype=torch.long)
    for i, text in enumerate(EXAMPLES):
        src[i, :len(text)] = torch.tensor(digits_to_tokens(text))
    return src.to(device)


def plot_attention(model, device, out_dir, max_len):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = EXAMPLES[0]
    src = encode_examples(device, max_len)[:1, :len(text)]
    with torch.no_grad():
        decoded = model.translate(src, len(text) + 1)[0].tolist()
        out_text = tokens_to_digits(decoded)
        tgt_in = torch.tensor([[1] + decoded[:len(out_text)]], device=device)
        model(src, tgt_in)  # fills attention_scores of every block
    src_labels = list(text)
    tgt_labels = ["<s>"] + list(out_text)
    panels = [("encoder self-attention", model.encoder[-1].self_attn.attention_scores, src_labels, src_labels),
              ("decoder masked self-attention", model.decoder[-1].self_attn.attention_scores, tgt_labels, tgt_labels),
              ("cross-attention", model.decoder[-1].cross_attn.attention_scores, tgt_labels, src_labels)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (title, weights, rows, cols) in zip(axes, panels):
        image = weights[0].float().mean(0).cpu()  # average over heads
        ax.imshow(image, cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel("keys")
        ax.set_ylabel("queries")
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"fastmha attention weights (last layer, mean over heads): {text} -> {out_text}")
    fig.tight_layout()
    path = out_dir / "attention.png"
    fig.savefig(path, dpi=100)
    return path


def plot_losses(ours, oracle, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(ours, label="fastmha", linewidth=1.2)
    ax.plot(oracle, label="oracle block", linewidth=1.2, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title("training loss: same initial weights, same batches")
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path, dpi=100)
    return path


def run_cpp(out_dir, model_path, max_len):
    source = ROOT / "examples" / "cpp" / "translate"
    build = out_dir / "translate-build"
    venv_cmake = Path(sys.executable).parent / "cmake"  # the environment's CMake (C++20 + CUDA needs >= 3.28)
    cmake = str(venv_cmake) if venv_cmake.exists() else "cmake"
    prefix = f"{torch.utils.cmake_prefix_path};{fastmha.cmake_prefix_path}"
    configure = [cmake, "-S", str(source), "-B", str(build), "-G", "Ninja", f"-DCMAKE_PREFIX_PATH={prefix}",
                 "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ccache"):
        configure.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    for command in (configure, [cmake, "--build", str(build)]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:])
            return None
    result = subprocess.run([str(build / "translate"), str(model_path), str(max_len), *EXAMPLES],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stdout, result.stderr)
        return None
    return [line.split("->")[1].strip() for line in result.stdout.strip().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "demo")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--skip-cpp", action="store_true", help="do not build and run the C++ translate example")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"fastmha {fastmha.__version__} | torch {torch.__version__} | {device} {args.dtype} | "
          f"{torch.get_num_threads()} threads | CPU kernels {fastmha._C.cpu_capability()}")

    torch.manual_seed(0)
    ours = Seq2Seq(fastmha.MultiHeadAttentionBlock).to(device, dtype)
    oracle = Seq2Seq(OracleAttention).to(device, dtype)
    oracle.load_state_dict(ours.state_dict(), strict=True)  # same parameter names: the weights move as they are
    print(f"model: {sum(p.numel() for p in ours.parameters())} parameters, 2+2 layers, d_model 64, 4 heads; "
          f"task: reverse digit strings of length 3..{args.max_len}")

    ours_losses, ours_acc, ours_time = train(ours, args, device, "fastmha")
    oracle_losses, oracle_acc, oracle_time = train(oracle, args, device, "oracle")
    window = max(1, args.steps // 10)
    tail = lambda xs: sum(xs[-window:]) / len(xs[-window:])  # noqa: E731
    accuracy = evaluate(ours, device, args)
    print(f"\nfinal loss (mean of last {window} steps): fastmha {tail(ours_losses):.4f} | oracle {tail(oracle_losses):.4f}")
    print(f"held-out token accuracy: fastmha {accuracy:.3f} | oracle {evaluate(oracle, device, args):.3f} "
          f"(chance: 0.09)")
    print(f"median step time: fastmha {ours_time * 1e3:.1f} ms | oracle {oracle_time * 1e3:.1f} ms | "
          f"speed-up {oracle_time / ours_time:.2f}x")

    src = encode_examples(device, args.max_len)
    with torch.no_grad():
        decoded = ours.eval().translate(src, args.max_len + 1).tolist()
    python_out = [tokens_to_digits(row) for row in decoded]
    print("\ngreedy decoding (target: the reversed string):")
    for text, out in zip(EXAMPLES, python_out):
        print(f"  {text:>10} -> {out:<10} {'ok' if out == text[::-1] else 'wrong'}")

    attention_png = plot_attention(ours, device, args.out, args.max_len)
    loss_png = plot_losses(ours_losses, oracle_losses, args.out)
    print(f"\npictures: {attention_png} {loss_png}")

    warnings.filterwarnings("ignore", message=".*torch.jit.* is deprecated")  # TorchScript is what C++ loads
    model_path = args.out / "translator.pt"
    scripted = torch.jit.script(ours.float().cpu().eval())
    scripted.save(str(model_path))
    print(f"TorchScript model: {model_path}")
    with torch.no_grad():  # what C++ must reproduce: the saved float32 model on the CPU
        expected = [tokens_to_digits(row) for row in scripted.translate(src.cpu(), args.max_len + 1).tolist()]

    ok = accuracy > 0.5 if args.steps >= 300 else True
    if not args.skip_cpp:
        cpp_out = run_cpp(args.out, model_path, args.max_len + 1)
        agree = cpp_out is not None and cpp_out == expected
        print(f"C++ examples/cpp/translate: {cpp_out} -> {'agrees with Python' if agree else 'DISAGREES'}")
        ok = ok and agree
    print("\ndemo " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
