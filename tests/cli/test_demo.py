"""``shard-swarm demo``, the README's first command (``make demo``), run as a user runs it: three node
processes on loopback serve the bundled model and one generation comes back. The fast tests stop
demo before any node starts; this one is the only test of the whole command (a node refusing the
settings demo gave it passed every fast test once)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
NEW = 8


def test_the_demo_runs_a_generation_on_three_nodes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarm.cli.main", "demo", "--json", "--max-new-tokens", str(NEW)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    receipt = json.loads(out.stdout)
    assert len(receipt["output_token_ids"]) == NEW or receipt["finish_reason"] == "eos", receipt
    assert receipt["text"].strip(), receipt
    assert len(receipt["peers"]) == 3, receipt["peers"]
