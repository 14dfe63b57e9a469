"""The benchmarks' harnesses run end to end on tiny CPU shapes (their numbers are not checked: benchmarks
measure, tests don't), so a script that runs only now and then (on a GPU machine, or to set the kernel choice)
cannot rot in between."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cuda_smoke_writes_every_result_file(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--smoke", "--device", "cpu",
                    "--dtype", "float32", "--out", str(tmp_path)], check=True, capture_output=True, timeout=300)
    stems = {path.suffix: path for path in tmp_path.iterdir()}
    assert set(stems) == {".json", ".csv", ".md", ".png"}
    rows = json.loads(stems[".json"].read_text())["rows"]
    cases = ("none", "causal", "padded+dropout", "padding", "padding+dropout")
    assert {(r["case"], r["mode"]) for r in rows} == {(c, m) for c in cases for m in ("fwd", "fwd+bwd")}
    assert all(r["ms_fastmha"] > 0 and r["ms_oracle"] > 0 for r in rows)


def test_profile_cuda_layer_smoke_times_and_profiles_every_peer(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_cuda_layer.py"), "--smoke", "--device", "cpu",
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (result,) = tmp_path.glob("profile-cpu-*-smoke.json")
    rows = json.loads(result.read_text())["rows"]
    # The masked case adds the default under FASTMHA_CUDA_MASKED=sdpa.
    expected = {(c, p) for c in ("none", "causal", "padding") for p in ("fastmha", "sdpa")}
    assert {(r["case"], r["peer"]) for r in rows} == expected | {("padding", "fastmha_sdpa")}
    assert all("error" not in r and r["step_ms"] > 0 and r["stream_ms"] > 0 and r["host_ms"] > 0 for r in rows)
    # The host's ops include the op that ran (fastmha's, or torch's for SDPA).
    for r in rows:
        ops = {name for name, _, _ in r["host_ops"]}
        assert any(name.startswith("fastmha::" if r["peer"] != "sdpa" else "aten::") for name in ops), ops
    assert "| host op | self us per step |" in result.with_suffix(".md").read_text()


def test_bench_quick_run_times_every_peer_and_writes_every_result_file(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--quick", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)
    stems = {path.suffix: path for path in tmp_path.iterdir()}
    assert set(stems) == {".json", ".csv", ".md", ".png"}
    rows = json.loads(stems[".json"].read_text())["rows"]
    peers = ("oracle", "sdpa", "mha_w", "mha_nw", "fastmha_w", "fastmha_nw", "bound")
    assert len(rows) == 3 and all(r[f"t_{peer}_ms"] > 0 for r in rows for peer in peers)
    assert all(r["speedup_bound_vs_oracle"] == pytest.approx(r["t_oracle_ms"] / r["t_bound_ms"]) for r in rows)
    assert "bound vs oracle" in stems[".md"].read_text()
    assert any(line.startswith("cpu isa:") for line in json.loads(stems[".json"].read_text())["meta"]["cpu"])
    assert "- cpu isa:" in stems[".md"].read_text()


def test_bench_kernel_choice_quick_run_with_fewer_queries(tmp_path):
    out = tmp_path / "queries-1.0"  # a dotted name keeps its dots
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel_choice.py"), "--quick", "--dtypes",
                    "bfloat16", "--query-length", "1", "--out", str(out)], check=True, capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "queries-1.0.json").read_text())["rows"]
    assert {(r["query_length"], r["length"]) for r in rows} == {(1, 64)}
    assert all(t > 0 for r in rows for t in r["ms"].values())


def test_bench_kernel_choice_quick_run_with_every_mask(tmp_path):
    out = tmp_path / "choice"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel_choice.py"), "--quick", "--dtypes",
                    "float32", "--masks", "none,padding,padding+causal,is_causal", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    masks = ("none", "padding", "padding+causal", "is_causal")
    assert {(r["mask"], r["pass"]) for r in rows} == {(m, p) for m in masks for p in ("fwd", "fwd+bwd")}
    assert all(t > 0 for r in rows for t in r["ms"].values())
    assert "| padding+causal | float32 |" in out.with_suffix(".md").read_text()


def test_plot_kernel_choice_draws_the_runs_it_is_given(tmp_path):
    bench, plot = (str(ROOT / "benchmarks" / name) for name in ("bench_kernel_choice.py", "plot_kernel_choice.py"))
    for dtype in ("float32", "bfloat16"):
        subprocess.run([sys.executable, bench, "--quick", "--dtypes", dtype, "--masks", "none,is_causal", "--out",
                        str(tmp_path / dtype)], check=True, capture_output=True, timeout=300)
    runs = [str(tmp_path / f"{dtype}.json") for dtype in ("float32", "bfloat16")]
    png = tmp_path / "plots" / "choice.png"
    subprocess.run([sys.executable, plot, *runs, "--out", str(png)], check=True, capture_output=True, timeout=120)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # A column the runs did not measure for a dtype is refused by name, and nothing is drawn.
    refused = subprocess.run([sys.executable, plot, runs[0], "--column", "native", "--out", str(tmp_path / "x.png")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--column native was not measured for float32" in refused.stderr
    assert not (tmp_path / "x.png").exists()


def test_bench_kernel_choice_pads_every_sequence_to_the_kept_share(tmp_path):
    out = tmp_path / "kept"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel_choice.py"), "--quick", "--dtypes",
                    "float32", "--masks", "padding", "--kept", "0.25", "--gemm", "--own-float-gemm", "brgemm",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    assert "padded sequences keep: 25% of the keys" in result["machine"]
    assert "own column's float32 P V: FASTMHA_CPU_FLOAT_GEMM=brgemm" in result["machine"]
    (forward,) = [r for r in result["rows"] if r["pass"] == "fwd"]
    # The rate counts the mask's visible pairs: a quarter of the keys for every query of every sequence.
    length = forward["length"]
    flops = 4 * forward["head_dim"] * forward["batch"] * 8 * length * (length // 4)
    assert forward["auto_gflops"] == pytest.approx(flops / forward["ms"]["auto"] / 1e6, rel=5e-2, abs=0.1)


def test_bench_kernel_choice_rejects_a_kept_share_outside_0_to_1():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel_choice.py"), "--quick", "--kept",
                          "1.5"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "--kept must lie in (0, 1], got 1.5" in run.stderr


def test_bench_kernel_choice_measures_half_type_products_with_kept_weights(tmp_path):
    out = tmp_path / "native"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel_choice.py"), "--quick", "--dtypes",
                    "bfloat16", "--need-weights", "--out", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    assert all(r["need_weights"] and r["ms"]["native"] > 0 for r in result["rows"])
    assert any(line.startswith("native column, bfloat16: bfloat16 products") for line in result["machine"])


def test_bench_kernel_choice_measures_the_forwards_products_alone(tmp_path):
    out = tmp_path / "gemm"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel_choice.py"), "--quick", "--dtypes",
                    "float32", "--masks", "none,is_causal", "--gemm", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    forward = [r for r in result["rows"] if r["pass"] == "fwd"]
    assert len(forward) == 2 and all(r["gemm_ms"] > 0 for r in forward)
    # The times in the JSON are rounded to the microsecond: a few percent at the quick size.
    assert all(r["auto_over_gemm"] == pytest.approx(r["ms"]["auto"] / r["gemm_ms"], rel=5e-2) for r in forward)
    for r in forward:
        length = r["length"]
        assert r["query_length"] == length
        # 4 d FLOPs per (query, key) pair: every pair, or the causal triangle's length (length + 1) / 2.
        pairs = length * (length + 1) // 2 if r["mask"] == "is_causal" else length * length
        flops = 4 * r["head_dim"] * r["batch"] * 8 * pairs
        assert r["auto_gflops"] == pytest.approx(flops / r["ms"]["auto"] / 1e6, rel=5e-2, abs=0.1)
    assert all(r["gemm_ms"] is None and r["auto_gflops"] is None for r in result["rows"] if r["pass"] == "fwd+bwd")
    assert any(line.startswith("torch.mm rate, float32") for line in result["machine"])
    assert "auto/gemm" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("dropout", ["0", "0.1"])
def test_bench_backward_from_weights_quick_run(tmp_path, dropout):
    out = tmp_path / "from-weights"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_backward_from_weights.py"), "--quick",
                    "--dropout", dropout, "--out", str(out)], check=True, capture_output=True, timeout=300)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {r["mask"] for r in rows} == {"none", "padding"}
    assert all(r["dropout"] == float(dropout) for r in rows)
    assert f"dropout {float(dropout)}" in out.with_suffix(".md").read_text()
    assert all(t > 0 for r in rows for t in r["ms"].values())
    assert "| padding | 1 | 128 |" in out.with_suffix(".md").read_text()


def test_bench_cpu_backward_kernels_quick_run(tmp_path):
    out = tmp_path / "backward-kernels"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_backward_kernels.py"), "--quick",
                          "--out", str(out)], check=True, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FASTMHA_LOG_KERNELS": "1"})
    # Both kernels ran the backward.
    backward = {line.split(" -> ")[1].split()[0] for line in run.stderr.splitlines() if "fastmha: backward" in line}
    assert backward == {"fastmha-cpu", "torch-cpu-flash"}, run.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    assert {r["mask"] for r in result["rows"]} == {"none", "padding"}
    assert all(r["ms"]["own"] > 0 and r["ms"]["stock"] > 0 for r in result["rows"])
    assert any(line.startswith("cpu isa:") for line in result["machine"])
    assert "| float32 | padding | 64 | 1 | 128 |" in out.with_suffix(".md").read_text()


def test_bench_cpu_backward_kernels_quick_run_in_half_types(tmp_path):
    out = tmp_path / "backward-half"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_backward_kernels.py"), "--quick", "--half",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {r["dtype"] for r in rows} == {"bfloat16", "float16"}
    assert all(r["ms"]["own"] > 0 and r["ms"]["stock"] > 0 for r in rows)


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_bench_model_quick_run_trains_and_decodes_with_every_block(tmp_path, autocast):
    out = tmp_path / "model"
    precision = ["--autocast", autocast] if autocast else []
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "--quick", "--out", str(out),
                    *precision], check=True, capture_output=True, timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["autocast"] == autocast
    assert f"precision: {'autocast ' + autocast if autocast else 'float32'}" in result["machine"]
    assert [r["task"] for r in result["rows"]] == ["train", "decode"]
    assert all(r["ms"][peer] > 0 for r in result["rows"] for peer in ("oracle", "fastmha", "bound"))
    assert all(r["oracle_over_bound"] == round(r["ms"]["oracle"] / r["ms"]["bound"], 3) for r in result["rows"])


def test_bench_double_backward_quick_run(tmp_path):
    out = tmp_path / "double-backward"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_double_backward.py"), "--quick", "--out",
                    str(out)], check=True, capture_output=True, timeout=300)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["batch"], r["length"]) for r in rows] == [(2, 16)]
    assert set(rows[0]["ms"]) == {"penalty_fastmha", "penalty_oracle", "plain_fastmha", "plain_oracle",
                                  "replay_fastmha", "replay_bernoulli"}
    assert all(t > 0 for t in rows[0]["ms"].values())
    assert rows[0]["penalty_ratio"] == pytest.approx(rows[0]["ms"]["penalty_oracle"] / rows[0]["ms"]["penalty_fastmha"],
                                                     abs=0.01)
    assert "| 2 | 16 | 32 | 4 |" in out.with_suffix(".md").read_text()


def test_bench_projections_quick_run(tmp_path):
    out = tmp_path / "projections"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_projections.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["part"], r.get("rows"), r.get("mode")) for r in rows] == [
        ("products", 512, None), ("block", None, "forward"), ("block", None, "forward + backward"),
        ("block", None, "backward")]
    assert all(t > 0 for r in rows for t in r["ms"].values())
    for r in rows:  # the BLAS's time over oneDNN's (products) or auto's (block)
        blas, other = r["ms"].values()
        assert r["ratio"] == pytest.approx(blas / other, abs=0.001)
    page = out.with_suffix(".md").read_text()
    assert "| 512 | 32 |" in page and "| 1 | 512 | forward |" in page and "| 1 | 512 | backward |" in page
    assert "AVX" in page


def test_bench_compile_quick_run(tmp_path):
    out = tmp_path / "compile"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_compile.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["task"], r["length"]) for r in rows] == [("train", 16), ("infer", 16)]
    peers = {f"{name}_{mode}" for name in ("oracle", "kept", "not_kept") for mode in ("eager", "compiled")}
    assert all(set(r["ms"]) == peers and all(t > 0 for t in r["ms"].values()) for r in rows)
    assert rows[0]["ratios"]["compiled_kept"] == pytest.approx(rows[0]["ms"]["oracle_compiled"]
                                                               / rows[0]["ms"]["kept_compiled"], abs=0.01)
    assert "| train | 2 | 16 |" in out.with_suffix(".md").read_text()


def run_gpu_check(tmp_path, **env):
    """scripts/gpu_check.sh's dry run (no GPU here) on the benchmark phase, with this Python."""
    out = tmp_path / "check"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
                            env={**os.environ, "PYTHON": sys.executable, "PHASES": "bench", **env},
                            capture_output=True, text=True, timeout=300)
    return result, out


def test_gpu_check_dry_run_packs_its_results_into_the_archive(tmp_path):
    result, out = run_gpu_check(tmp_path, ARCHIVE=str(tmp_path / "check.tar.gz"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bench-core-smoke: rc=0" in (out / "summary.txt").read_text()
    with tarfile.open(tmp_path / "check.tar.gz") as archive:
        names = archive.getnames()
    assert "check/summary.txt" in names and "check/environment.txt" in names
    assert any(name.startswith("check/bench/") and name.endswith(".md") for name in names)


def test_gpu_check_skips_a_phase_past_its_budget_and_fails(tmp_path):
    result, out = run_gpu_check(tmp_path, BUDGET_S="5")
    assert result.returncode != 0
    summary = (out / "summary.txt").read_text()
    assert "bench-core-smoke: skipped" in summary and "rc=" not in summary
