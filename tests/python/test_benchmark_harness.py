"""The GPU benchmark's harness runs end to end on tiny CPU shapes (its numbers are not checked: benchmarks
measure, tests don't), so the script a GPU machine runs cannot rot between runs on one."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cuda_smoke_writes_every_result_file(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--smoke", "--device", "cpu",
                    "--dtype", "float32", "--out", str(tmp_path)], check=True, capture_output=True, timeout=300)
    stems = {path.suffix: path for path in tmp_path.iterdir()}
    assert set(stems) == {".json", ".csv", ".md", ".png"}
    rows = json.loads(stems[".json"].read_text())["rows"]
    assert {(r["case"], r["mode"]) for r in rows} == {(c, m) for c in ("none", "causal", "padding+dropout")
                                                       for m in ("fwd", "fwd+bwd")}
    assert all(r["ms_fastmha"] > 0 and r["ms_oracle"] > 0 for r in rows)
