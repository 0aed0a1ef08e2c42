"""`jaxserve bench compare` drives real `jaxserve run` servers and `jaxserve bench serve` end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_compare_runs_two_variants_side_by_side(tiny_model_dir):
    path, _ = tiny_model_dir("llama3")
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "bench", "compare", "custom",
        "--config", str(ROOT / "configs" / "test-tiny.yaml"), "--set", f"model={path}",
        "--variant", "a:max_num_seqs=2", "--variant", "b:max_num_seqs=8,enable_prefix_caching=false",
        "--bench-args=--workload random --num-requests 8 --vocab 320 --output-len 4:8 --input-len 5:20",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    rows = [x for x in lines if x.startswith(("a ", "b "))]
    assert len(rows) == 2 and rows[0].rstrip().endswith("1.00x")
