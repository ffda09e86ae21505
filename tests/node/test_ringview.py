"""ringview.build_view: a peer's status dict -> the ring as `status` and the console show it."""

from __future__ import annotations

from typing import Any

from swarm.node.generation.ringview import build_view


def _status(**over: Any) -> dict[str, Any]:
    st: dict[str, Any] = {
        "peer_id": "B",
        "epoch": 7,
        "serving": True,
        "leader": "A",
        "plan": {"coordinator": "C", "ring": ["A", "B"], "blocks": {"A": [0, 10], "B": [10, 30]}, "standbys": ["S"]},
        "members": ["A", "B", "C", "S", "M"],
        "peers_file": {
            "peers": [{"id": "A", "memory_gb": 2.5, "ms_per_layer": 0.4}, {"id": "B", "memory_gb": 4}],
            "rtt_ms": {"C": {"A": 1.5}, "A": {"B": 2.0}, "B": {"C": 3.25}},
        },
        "peer_info": {"B": {"memory_used_bytes": 1_500_000_000, "device": "cpu\x1b[31m", "heartbeat_age_s": 0.5}},
        "recent": {"tokens_per_s": 12.5, "accepted_per_traversal": 2.0},
        "replans": [{"epoch": 6}],
        "hops": [{"hop": 0}, "not a hop"],
        "memory": {"offered_bytes": 4_000_000_000, "predicted_peak_bytes": 3_000_000_000, "measured_peak_bytes": True},
    }
    st.update(over)
    return st


def test_the_ring_reads_in_hop_order_with_each_peers_block_rtt_and_memory() -> None:
    v = build_view(_status())
    assert [(r["peer"], r["role"], r["block"], r["layers"], r["next"]) for r in v["ring"]] == [
        ("C", "coordinator", None, 0, "A"),  # a coordinator without layers comes first
        ("A", "stage", [0, 10], 10, "B"),
        ("B", "stage", [10, 30], 20, "C"),  # the tail returns straight to the coordinator
    ]
    assert [r["rtt_next_ms"] for r in v["ring"]] == [1.5, 2.0, 3.25] and v["ring_rtt_ms"] == 6.75
    a, b = v["ring"][1], v["ring"][2]
    assert (a["memory_offered_gb"], a["ms_per_layer"], a["memory_used_gb"]) == (2.5, 0.4, None)
    assert (b["memory_offered_gb"], b["memory_used_gb"], b["heartbeat_age_s"]) == (4.0, 1.5, 0.5)
    assert "\x1b" not in b["device"]  # what a member says about itself is shown without control characters
    assert [(o["peer"], o["role"]) for o in v["others"]] == [("S", "standby"), ("M", "member")]
    assert (v["asked"], v["epoch"], v["serving"], v["leader"], v["replans"]) == ("B", 7, True, "A", 1)
    assert (v["tokens_per_s"], v["accepted_per_traversal"], v["hops"]) == (12.5, 2.0, [{"hop": 0}])
    # a bool is not a byte count: left out, never shown as 1e-9 GB
    assert v["memory"] == {"offered_gb": 4.0, "predicted_peak_gb": 3.0, "measured_peak_gb": None, "measured_rss_gb": None}


def test_a_coordinator_in_the_ring_and_an_unknown_rtt_are_said_as_such() -> None:
    st = _status(plan={"coordinator": "A", "ring": ["A", "B"], "blocks": {"A": [0, 15], "B": [15, 30]}})
    st["peers_file"]["rtt_ms"] = {"B": {"A": 2.0}}  # measured one way: an RTT is the pair's, either way
    v = build_view(st)
    assert [(r["peer"], r["role"], r["next"]) for r in v["ring"]] == [("A", "coordinator+stage", "B"), ("B", "stage", "A")]
    assert [r["rtt_next_ms"] for r in v["ring"]] == [2.0, 2.0] and v["ring_rtt_ms"] == 4.0
    st["peers_file"]["rtt_ms"] = {"A": {"B": 2.0}, "C": {"A": 9.0}}
    st["plan"] = {"coordinator": "C", "ring": ["A", "B"], "blocks": {"A": [0, 15], "B": [15, 30]}}
    v = build_view(st)  # B -> C never measured
    assert [r["rtt_next_ms"] for r in v["ring"]] == [9.0, 2.0, None] and v["ring_rtt_ms"] is None  # never a partial sum
    assert [o["peer"] for o in v["others"]] == ["S", "M"] and {o["role"] for o in v["others"]} == {"member"}


def test_a_node_without_a_plan_shows_its_members_and_nothing_invented() -> None:
    v = build_view({"peer_id": "X", "members": ["X", "Y"]})
    assert v["ring"] == [] and v["coordinator"] is None and v["ring_rtt_ms"] is None
    assert [o["peer"] for o in v["others"]] == ["X", "Y"] and not v["serving"]
    assert v["memory"] == dict.fromkeys(("offered_gb", "predicted_peak_gb", "measured_peak_gb", "measured_rss_gb"))
