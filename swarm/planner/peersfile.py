"""The peers-file format: what a running swarm exports and ``shard-swarm plan --peers`` reads.

    {"peers": [{"id": "alice", "memory_gb": 24, "ms_per_layer": 0.7, "coordinator_ok": true,
                "addresses": ["/ip4/..."], "draft_ms": 4.5, "draft_gb": 1.2,  # draft: optional
                "held": {"0": 10}, "held_head": true, "disk_gb": 40,  # optional: layers 0-9 and
                                                 # the head on disk, 40 GB free for more (none: unbounded)
                "sessions": 2,                   # optional: the sessions' KV its stage reserves
                                                 # (none: the planning spec's count)
                "dtype_bytes": 4}],              # optional: the width it serves in (none: 2)
     "rtt_ms": {"alice": {"bob": 12.5}},          # a missing pair means unreachable
     "one_way_ms": {"alice": {"bob": 5.9}}}       # optional measured one-way latencies

Parsing is pure (a dict in, numbers out); reading the file is the caller's job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swarm.errors import UsageError
from swarm.planner.spec import GB, Latency, Peer

MAX_HELD_LAYER = 1 << 16  # as an advert's (swarm.proto.messages.MAX_LAYER; the planner imports no proto)


@dataclass(frozen=True)
class PeersFile:
    peers: tuple[Peer, ...]
    rtt_ms: dict[str, dict[str, float]]
    one_way_ms: dict[str, dict[str, float]]

    def latency(self) -> Latency:
        return Latency(self.rtt_ms, self.one_way_ms)


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise UsageError(f"{where}: expected a finite number >= 0, got {v!r}")
    return float(v)


def _matrix(obj: Any, ids: set[str], where: str) -> dict[str, dict[str, float]]:
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise UsageError(f"{where}: expected an object of objects")
    out: dict[str, dict[str, float]] = {}
    for a, row in obj.items():
        if a not in ids:
            raise UsageError(f"{where}: {a!r} is not a listed peer")
        if not isinstance(row, Mapping):
            raise UsageError(f"{where}[{a!r}]: expected an object")
        for b, v in row.items():
            if b not in ids:
                raise UsageError(f"{where}[{a!r}]: {b!r} is not a listed peer")
            if v is None:
                continue  # explicit null: unreachable, same as missing
            out.setdefault(a, {})[b] = _number(v, f"{where}[{a!r}][{b!r}]")
    return out


def _held(obj: Any, where: str) -> frozenset[int]:
    """Layer ranges {"start": end} (as in an advert) -> the layers."""
    if obj is None:
        return frozenset()
    if not isinstance(obj, Mapping):
        raise UsageError(f'{where}: expected layer ranges {{"start": end}}')
    out: set[int] = set()
    for k, end in obj.items():
        ok = isinstance(k, str) and k.isdigit() and isinstance(end, int) and not isinstance(end, bool)
        if not ok or not int(k) < end <= MAX_HELD_LAYER:
            raise UsageError(f"{where}: {k!r}: {end!r} is not a range of layers (a start below its end)")
        out.update(range(int(k), end))
    return frozenset(out)


def held_ranges(layers: Iterable[int]) -> dict[str, int]:
    """The inverse of _held: layers as ranges {"start": end}."""
    out: dict[str, int] = {}
    start = end = -1
    for i in sorted(set(layers)):
        if i != end:
            if end > start >= 0:
                out[str(start)] = end
            start = i
        end = i + 1
    if end > start >= 0:
        out[str(start)] = end
    return out


def parse_peers_file(obj: Any, *, where: str = "peers file") -> PeersFile:
    """Validate a decoded peers file; UsageError naming the field and entry that is wrong."""
    if not isinstance(obj, Mapping):
        raise UsageError(f"{where}: expected a JSON object with a 'peers' list")
    raw = obj.get("peers")
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
        raise UsageError(f"{where}: 'peers' must be a non-empty list")
    peers: list[Peer] = []
    ids: set[str] = set()
    for k, entry in enumerate(raw):
        at = f"{where}: peers[{k}]"
        if not isinstance(entry, Mapping):
            raise UsageError(f"{at}: expected an object")
        pid = entry.get("id")
        if not isinstance(pid, str) or not pid:
            raise UsageError(f"{at}: 'id' must be a non-empty string")
        at = f"{where}: peer {pid!r}"
        if pid in ids:
            raise UsageError(f"{at} is listed twice")
        for key in ("memory_gb", "ms_per_layer"):
            if key not in entry:
                raise UsageError(f"{at}: missing '{key}'")
        mem = _number(entry["memory_gb"], f"{at}: memory_gb")
        speed = _number(entry["ms_per_layer"], f"{at}: ms_per_layer")
        ok = entry.get("coordinator_ok", True)
        if not isinstance(ok, bool):
            raise UsageError(f"{at}: coordinator_ok must be true or false")
        addrs = entry.get("addresses", [])
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise UsageError(f"{at}: addresses must be a list of strings")
        draft_ms = None if entry.get("draft_ms") is None else _number(entry["draft_ms"], f"{at}: draft_ms")
        draft_gb = _number(entry.get("draft_gb", 0), f"{at}: draft_gb")
        held = _held(entry.get("held"), f"{at}: held")
        head = entry.get("held_head", False)
        if not isinstance(head, bool):
            raise UsageError(f"{at}: held_head must be true or false")
        disk = None if entry.get("disk_gb") is None else int(round(_number(entry["disk_gb"], f"{at}: disk_gb") * GB))
        sessions = entry.get("sessions")
        if sessions is not None and (isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1):
            raise UsageError(f"{at}: sessions must be a whole number >= 1, got {sessions!r}")
        width = entry.get("dtype_bytes")
        if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width not in (1, 2, 4, 8)):
            raise UsageError(f"{at}: dtype_bytes must be 1, 2, 4 or 8, got {width!r}")
        peers.append(Peer(pid, int(round(mem * GB)), speed, ok, tuple(addrs), draft_ms, int(round(draft_gb * GB)),
                          held, head, disk, sessions, width))  # fmt: skip
        ids.add(pid)
    rtt = _matrix(obj.get("rtt_ms"), ids, f"{where}: rtt_ms")
    one = _matrix(obj.get("one_way_ms"), ids, f"{where}: one_way_ms")
    return PeersFile(tuple(peers), rtt, one)


def dump_peers_file(
    peers: Sequence[Peer], rtt_ms: Mapping[str, Mapping[str, float]]
) -> dict[str, Any]:
    """The inverse of parse_peers_file (what a running swarm exports)."""
    return {
        "peers": [
            {
                "id": p.id,
                "memory_gb": p.memory_bytes / GB,
                "ms_per_layer": p.ms_per_layer,
                "coordinator_ok": p.coordinator_ok,
                **({"addresses": list(p.addresses)} if p.addresses else {}),
                **({"draft_ms": p.draft_ms, "draft_gb": p.draft_bytes / GB} if p.draft_ms is not None else {}),
                **({"held": held_ranges(p.held)} if p.held else {}),
                **({"held_head": True} if p.held_head else {}),
                **({"disk_gb": p.disk_bytes / GB} if p.disk_bytes is not None else {}),
                **({"sessions": p.sessions} if p.sessions is not None else {}),
                **({"dtype_bytes": p.dtype_bytes} if p.dtype_bytes is not None else {}),
            }
            for p in sorted(peers, key=lambda p: p.id)
        ],
        "rtt_ms": {a: dict(sorted(row.items())) for a, row in sorted(rtt_ms.items())},
    }
