"""``shard-swarm generate`` against a running swarm of node processes, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm.launch import start_local_swarm
from swarm.model.driver import output_sha256
from swarm.model.generate import LocalModel, generate
from swarm.testing.checkpoints import TinySpec, write_checkpoint

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]


def test_generate_cli_json_receipt_matches_one_box(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "tiny", TinySpec(n_layers=6, row_gain_spread=1.0), seed=3)
    torch.set_num_threads(1)
    want = generate(LocalModel.load(ckpt, stages=1, dtype=torch.float32), PROMPT, max_new_tokens=20,
                    eos_token_ids=()).output_token_ids
    with start_local_swarm(2, ckpt, dtype="fp32") as swarm:
        receipt_file = tmp_path / "receipt.json"
        out = subprocess.run(
            [sys.executable, "-m", "swarm.cli.main", "generate", "--manifest", str(swarm.workdir / "invite.json"),
             "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "20", "--draft", "none",
             "--json", "--receipt", str(receipt_file), "--timeout", "90"],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        receipt = json.loads(out.stdout)
        assert receipt["output_token_ids"][: len(want)] == want[: len(receipt["output_token_ids"])]
        assert receipt["output_sha256"] == output_sha256(receipt["output_token_ids"])
        assert receipt["text"] == ""  # what was streamed (this tiny checkpoint has no tokenizer: no text)
        assert json.loads(receipt_file.read_text()) == receipt
        # a tampered invite is refused with the manifest exit code, before any network traffic
        bad = tmp_path / "tampered.json"
        data = json.loads((swarm.workdir / "invite.json").read_text())
        data["swarm_name"] = data.get("swarm_name", "x") + "!"
        bad.write_text(json.dumps(data))
        out = subprocess.run(
            [sys.executable, "-m", "swarm.cli.main", "generate", "--manifest", str(bad), "--prompt", "hi"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 4, (out.returncode, out.stderr[-2000:])
