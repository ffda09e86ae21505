"""A status reply is bounded by construction (issue 27): cut, never failed."""

from __future__ import annotations

import json

from swarm.node.generation.report import STATUS_BUDGET, bounded
from swarm.proto.text import clean, printable


def test_a_status_of_any_size_is_cut_to_the_budget_in_order() -> None:
    members = [f"M{i:03d}" for i in range(256)]
    st = {
        "members": members,
        "peer_info": {p: {"device": "cuda:" + "x" * 80} for p in members + [f"F{i}" for i in range(256)]},
        "peers_file": {"peers": [{"id": p, "memory_gb": 1} for p in members + ["F1"]],
                       "rtt_ms": {p: {q: 1.0 for q in members} for p in members}},
        "replans": [{"epoch": i, "reason": "r" * 200} for i in range(100)],
        "plan": {"coordinator": "M000"},
    }  # fmt: skip
    out = bounded(st)
    assert len(json.dumps(out).encode()) <= STATUS_BUDGET
    assert out["truncated"][0] == "other adverts" and out["plan"] == {"coordinator": "M000"}
    assert out["members"] == members
    small = {"members": ["A"], "peer_info": {}, "peers_file": {"peers": []}, "replans": []}
    assert bounded(small) == small  # nothing cut when it fits


def test_member_text_loses_its_control_characters() -> None:
    nasty = "gpu\x1b[2J\x07\r\nFAKE\ud800\u202e"
    assert clean(nasty) == "gpu[2JFAKE"
    assert clean(nasty, 4) == "gpu["
    assert printable(nasty) == "gpu\\x{1b}[2J\\x{7}\\x{d}\\x{a}FAKE\\x{d800}\\x{202e}"
    json.dumps(clean(nasty))  # encodable
