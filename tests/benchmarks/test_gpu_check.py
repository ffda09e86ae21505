"""benchmarks/gpu_check.py runs on the CPU with small shapes, so the one script a lent GPU runs
cannot rot: every step runs (formats, MoE layers, logits, 70B- and gpt-oss-shaped layers, the
out-of-memory path, a 3-process ring greedy and sampled with a draft model) and passes its checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # every step of the script in a subprocess, a 3-process ring among them (~20 s)
def test_gpu_check_passes_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check_cpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--small",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failed"] == [], json.dumps(result, indent=1)[-4000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {"capability", "formats", "logits", "layers", "oom", "ring"}
    assert steps <= set(result), sorted(result)
    assert all("error" not in result[s] for s in steps if isinstance(result[s], dict))
    assert result["formats"]["moe_gpt_oss"] and result["ring"]["greedy_identical"]
    assert {"llama-3.3-70b/int4", "gpt-oss-120b/int4"} <= set(result["layers"])
    assert result["oom"]["simulated"] and result["oom"]["serves_after"]


def test_gpu_check_without_the_device_says_why_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cuda:7", "--out", str(out)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    if "skipped" not in proc.stdout:  # this machine has that GPU: nothing to check here
        return
    assert proc.returncode == 0 and "cuda" in proc.stdout and not out.exists()
