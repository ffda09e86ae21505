"""The seed's consumer proofs, planned from the models' published config.json (no weights):
gpt-oss-120B on three 24 GB GPUs with its experts kept MXFP4, and Llama-3.3-70B in int4. Each
peer's predicted peak (its layers, their KV cache for the context, and the coordinator's
embedding and head where it coordinates) must stay under what its card offers: ``--memory
auto`` of a 24 GiB card (devices.py: free memory less 1 GiB and 5%). On a GPU a peer's overhead
is 0 (planner/budget.py), so its offer is all room for the planned part. Each stage reserves the
KV of SESSIONS sessions: gpt-oss-120B's MXFP4 layers leave room for 6 at 4096 tokens, not 8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from swarm.cli.main import main
from swarm.model.config import ModelArgs
from swarm.model.devices import gpu_margin_bytes
from swarm.model.quant import layer_bytes_each

CONFIGS = Path(__file__).resolve().parents[2] / "swarm" / "testing" / "configs"
CARD = 24 * 2**30  # an RTX 4090
OFFERED = CARD - gpu_margin_bytes(CARD)  # 23.41 GB: what --memory auto offers on an empty card
CONTEXT = 4096
SESSIONS = 4


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, quant: str,
          sessions: int = SESSIONS) -> tuple[int, dict]:
    model = tmp_path / name
    model.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", model / "config.json")
    peers = {"peers": [{"id": f"gpu-{c}", "memory_gb": OFFERED / 1e9, "ms_per_layer": 0.5} for c in "abc"],
             "rtt_ms": {"gpu-a": {"gpu-b": 20.0, "gpu-c": 30.0}, "gpu-b": {"gpu-c": 25.0}}}
    (tmp_path / "peers.json").write_text(json.dumps(peers))
    rc = main(["plan", "--peers", str(tmp_path / "peers.json"), "--model", str(model), "--quant", quant,
               "--context", str(CONTEXT), "--sessions", str(sessions), "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if rc == 0 else {"err": out.err}


def _peaks(name: str, quant: str, plan: dict) -> dict[str, int]:
    args = ModelArgs.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))
    each = layer_bytes_each(args, quant, 2)
    kv = args.kv_bytes_per_token_per_layer(2) * CONTEXT * SESSIONS
    peaks = {}
    for pid, (s, e) in plan["blocks"].items():
        peaks[pid] = sum(each[s:e]) + (e - s) * kv + (args.head_bytes(2) if pid == plan["coordinator"] else 0)
    return peaks


@pytest.mark.parametrize(("name", "quant", "layers"), [("gpt-oss-120b", "mxfp4", 36), ("llama-3.3-70b", "int4", 80)])
def test_published_model_fits_three_24gb_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              name: str, quant: str, layers: int) -> None:
    rc, plan = _plan(tmp_path, capsys, name, quant)
    assert rc == 0, plan
    assert sum(e - s for s, e in plan["blocks"].values()) == layers and len(plan["blocks"]) == 3
    peaks = _peaks(name, quant, plan)
    assert all(p <= OFFERED for p in peaks.values()), {k: p / 1e9 for k, p in peaks.items()}
    assert max(peaks.values()) < CARD
    # the plan's own predicted peaks (budget.py): the same sums plus one prefill chunk's activations
    said = plan["predicted_peak_bytes"]
    assert said.keys() == peaks.keys() and all(peaks[p] < said[p] <= OFFERED for p in peaks), (said, peaks)


def test_gpt_oss_120b_reserving_eight_sessions_is_a_layer_short(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The whole budget is honest: eight sessions' KV at 4096 tokens on top of the layers leaves
    no room for the last layer, and the planner says so rather than a card running out later."""
    rc, out = _plan(tmp_path, capsys, "gpt-oss-120b", "mxfp4", sessions=8)
    assert rc == 5 and "8 sessions of 4096 tokens" in out["err"], out


def test_gpt_oss_120b_rounded_to_int4_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Why MXFP4 must stay MXFP4: int4 in groups of 32 (4.5 bits with its bf16 scales and zeros)
    needs ~72 GB of layers + 2.3 GB of head against ~70 GB offered."""
    rc, out = _plan(tmp_path, capsys, "gpt-oss-120b", "int4")
    assert rc == 5 and "not enough memory" in out["err"], out
    assert "fits with --quant mxfp4" in out["err"]
