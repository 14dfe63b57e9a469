"""The main job (examples/python/demo.py) runs end to end with a tiny step count, including the C++ part."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "python" / "demo.py"), "--steps", "8",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "demo OK" in result.stdout
    assert "agrees with Python" in result.stdout
    for name in ("attention.png", "loss.png", "translator.pt"):
        assert (tmp_path / name).stat().st_size > 0
