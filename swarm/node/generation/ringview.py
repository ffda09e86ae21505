"""The ring as a person reads it: a peer's status dict -> one view, shared by ``shard-swarm status``
(its table, text and JSON) and the web console (swarm/api/console.py).

``build_view`` is a pure function: the coordinator, the stages in ring order with their blocks,
device, memory used and offered, ms per layer, RTT to the next hop, heartbeat age and how each
peer is reached, plus the swarm's recent tok/s and tokens accepted per traversal. Fields the node
does not report (yet) are None, never guessed.
"""

from __future__ import annotations

from typing import Any

from swarm.proto.text import clean

GB = 1e9


def _rtt(rtt: dict[str, dict[str, float]], a: str, b: str) -> float | None:
    v = rtt.get(a, {}).get(b)
    if v is None:
        v = rtt.get(b, {}).get(a)
    return None if v is None else float(v)


def build_view(st: dict[str, Any]) -> dict[str, Any]:
    """The status dict of a peer -> what the status command shows (JSON-ready)."""
    plan = st.get("plan") or {}
    coord = plan.get("coordinator")
    ring: list[str] = list(plan.get("ring") or [])
    blocks = plan.get("blocks") or {}
    pf = st.get("peers_file") or {}
    adverts = {p.get("id"): p for p in pf.get("peers") or [] if isinstance(p, dict)}
    rtt = pf.get("rtt_ms") or {}
    info = st.get("peer_info") or {}

    def row(peer: str, role: str, nxt: str | None) -> dict[str, Any]:
        adv, extra = adverts.get(peer, {}), info.get(peer, {})
        blk = blocks.get(peer)
        offered = adv.get("memory_gb")
        used = extra.get("memory_used_bytes")
        return {
            "peer": peer, "role": role, "block": list(blk) if blk else None,
            "layers": (blk[1] - blk[0]) if blk else 0, "device": _text(extra.get("device")),
            "memory_used_gb": None if used is None else used / GB,
            "memory_offered_gb": None if offered is None else float(offered),
            "ms_per_layer": adv.get("ms_per_layer"),
            "next": nxt, "rtt_next_ms": _rtt(rtt, peer, nxt) if nxt else None,
            "heartbeat_age_s": extra.get("heartbeat_age_s"), "path": _text(extra.get("path")),
        }  # fmt: skip

    rows: list[dict[str, Any]] = []
    if coord is not None:
        hops = [coord, *ring, coord]
        if coord not in ring:
            rows.append(row(coord, "coordinator", hops[1]))
        for i, peer in enumerate(ring):
            rows.append(row(peer, "coordinator+stage" if peer == coord else "stage", hops[i + 2]))
    placed = {r["peer"] for r in rows}
    standbys = set(plan.get("standbys") or [])
    others = [row(p, "standby" if p in standbys else "member", None) for p in st.get("members") or [] if p not in placed]
    hop_rtts = [r["rtt_next_ms"] for r in rows]
    recent = st.get("recent") or {}
    return {
        "asked": st.get("peer_id"), "epoch": st.get("epoch"), "serving": bool(st.get("serving")),
        "leader": st.get("leader"), "coordinator": coord, "ring": rows, "others": others,
        "ring_rtt_ms": sum(hop_rtts) if rows and all(v is not None for v in hop_rtts) else None,
        "tokens_per_s": recent.get("tokens_per_s"), "accepted_per_traversal": recent.get("accepted_per_traversal"),
        "replans": len(st.get("replans") or []),
        "hops": [h for h in st.get("hops") or [] if isinstance(h, dict)],
        "memory": _memory(st.get("memory")),  # the asked node's predicted peak beside its measured one
    }  # fmt: skip


def _memory(m: Any) -> dict[str, float | None]:
    """The asked node's memory in GB: offered, predicted peak (planner/budget.py), measured peak and now."""
    m = m if isinstance(m, dict) else {}

    def gb(key: str) -> float | None:
        v = m.get(key)
        return v / GB if isinstance(v, int | float) and not isinstance(v, bool) else None

    return {"offered_gb": gb("offered_bytes"), "predicted_peak_gb": gb("predicted_peak_bytes"),
            "measured_peak_gb": gb("measured_peak_bytes"), "measured_rss_gb": gb("measured_rss_bytes")}  # fmt: skip


def _text(v: Any) -> str | None:
    """What a member says about itself, for a terminal or a page: no control characters."""
    return None if v is None else clean(v, 200)
