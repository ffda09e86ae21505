"""bench_ring's where_the_time_goes from a written trace (one token round a 2-stage ring): each
row is the right difference of timestamps, a stage's result counts as out when its send returned
(not after the checkpoint behind it), and the trace says which source tree each node ran (--ab
checks the base swarm's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_ring  # noqa: E402


def _write(trace: Path, pid: int, events: list[dict[str, Any]]) -> None:
    (trace / f"ring-trace-{pid}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_where_the_time_goes_takes_a_stage_out_at_its_send(tmp_path: Path) -> None:
    code = {"k": "code", "file": "/src/tree/swarm/node/ring/stage_worker.py"}
    stage = {"k": "stage", "s": 1, "c": 5, "n": 1, "batch": 1}
    _write(tmp_path, 1, [code, {"k": "send", "s": 1, "c": [5], "t_in": 0.0, "t_out": 1.000},
                         {"k": "result", "s": 1, "c": 5, "t": 1.030},
                         {"k": "logits", "t0": 1.031, "t1": 1.038}, {"k": "embed", "t0": 1.0385, "t1": 1.0386},
                         {"k": "send", "s": 1, "c": [6], "t_in": 1.038, "t_out": 1.040}])  # fmt: skip
    # stage 0: its send returned at 1.0125, its batch ended (after a checkpoint) at 1.015
    _write(tmp_path, 2, [code, stage | {"a": 0, "b": 13, "t_in": 1.001, "t_run": 1.0012, "f0": 1.0015, "f1": 1.012,
                                        "t_out": 1.015},
                         {"k": "sent", "s": 1, "c": 5, "t": 1.0125}])  # fmt: skip
    _write(tmp_path, 3, [code, stage | {"a": 13, "b": 30, "t_in": 1.013, "t_run": 1.0132, "f0": 1.0135, "f1": 1.028,
                                        "t_out": 1.0285}])  # fmt: skip
    got = bench_ring.analyse_trace(tmp_path, {"ring": ["p0", "p1"]})
    ms = got["ms_median"]
    assert got["chunks_traced"] == 1 and got["code"] == ["/src/tree"] and got["errors"] == []
    assert round(ms["stage0 [0,13)   out (forward -> sent)"], 2) == 0.5, "out at its send, not at 1.015"
    assert round(ms["hop1 transport"], 2) == 0.5
    assert round(ms["stage0 [0,13) compute"], 2) == 10.5 and round(ms["stage1 [13,30) compute"], 2) == 14.5
    assert round(ms["hop2 transport (tail -> coordinator)"], 2) == 1.5
    assert round(ms["coordinator LM head"], 2) == 7.0 and round(ms["token cycle (send -> next send)"], 2) == 40.0
    other = 40.0 - 1.0 - 11.5 - 0.5 - 15.5 - 1.5 - 7.0 - 0.1  # the cycle less hops, stages (in to out), head, embed
    assert round(ms["coordinator other (decoder, hand-offs, encode, send)"], 2) == round(other, 2)
