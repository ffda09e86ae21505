"""Layer counts per stage: fit memory, minimise summed compute, balance equal-speed peers.

For a fixed set of ring nodes the traversal's compute term is ``sum(layers_i * ms_per_layer_i)``,
a linear function over integer counts boxed by memory (``lb_i <= layers_i <= cap_i``) with a fixed
total. Its minimum is greedy: give every stage its lower bound (1 layer; 0 for the coordinator,
which may stay layer-less), then fill the fastest peers first. Peers of equal speed are
water-filled to equal counts (ties by peer ID), which changes nothing in the sum but keeps
pipeline stages balanced and leaves memory headroom. So a slow peer gets fewer layers, or none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.planner.budget import predicted_peak
from swarm.planner.spec import Latency, ModelSpec, Peer


@dataclass
class Ctx:
    """Peers indexed in sorted-ID order, with their capacities precomputed."""

    spec: ModelSpec
    peers: list[Peer]  # sorted by ID
    lat: Latency
    cap: list[int]  # layers that fit as a plain stage
    capc: list[int]  # layers that fit next to the coordinator part; -1: may not coordinate
    rank: list[int]  # position in the order (ms_per_layer, id): fastest first
    per_layer: int  # bytes each layer is counted at in cap/capc, at the spec's own sessions (messages)
    specs: list[ModelSpec]  # the spec with each peer's own sessions, at its own width (Peer.own)

    @classmethod
    def build(cls, spec: ModelSpec, peers: Sequence[Peer], lat: Latency, smallest: bool = False) -> Ctx:
        """Capacities count every layer at the largest layer's bytes (so any block they allow
        fits; ``smallest``: at the smallest's, as planner.py searches before checking exactly),
        each peer's KV at its own sessions."""
        ps = sorted(peers, key=lambda p: p.id)
        cap = [p.layer_capacity(spec, smallest=smallest) for p in ps]
        capc = [p.layer_capacity(spec, coordinator=True, smallest=smallest) if p.coordinator_ok else -1 for p in ps]
        by_speed = sorted(range(len(ps)), key=lambda i: (ps[i].ms_per_layer, ps[i].id))
        rank = [0] * len(ps)
        for r, i in enumerate(by_speed):
            rank[i] = r
        per_layer = spec.smallest_bytes_per_layer if smallest else spec.bytes_per_layer
        return cls(spec, ps, lat, cap, capc, rank, per_layer, [p.own(spec) for p in ps])

    @property
    def n(self) -> int:
        return len(self.peers)

    def d(self, i: int, j: int) -> float:
        return self.lat.hop(self.peers[i].id, self.peers[j].id)

    def speed(self, i: int) -> float:
        return self.peers[i].ms_per_layer

    def fits(self, i: int, start: int, end: int, coordinator: bool) -> bool:
        """Whether peer ``i`` holds layers [start, end) at their own sizes (and the coordinator
        part) in memory, and what it must fetch of them on disk."""
        p = self.peers[i]
        peak = predicted_peak(self.specs[i], (start, end), coordinator=coordinator, draft_bytes=p.draft_bytes)
        return peak <= p.memory_bytes and p.stores(self.spec, start, end, coordinator=coordinator)


def allocate(ctx: Ctx, nodes: Sequence[int], coord: int) -> tuple[float, list[int]] | None:
    """Best layer counts for ``nodes`` (in that order) with ``coord`` as coordinator.

    ``coord`` must be in ``nodes``; it gets between 0 and ``capc[coord]`` layers, every other node
    between 1 and ``cap``. Returns (compute ms, counts) or None when no count fits.
    """
    total = ctx.spec.n_layers
    lb = [0 if i == coord else 1 for i in nodes]
    ub = [ctx.capc[i] if i == coord else ctx.cap[i] for i in nodes]
    for lo, hi in zip(lb, ub, strict=True):
        if hi < lo:
            return None
    rem = total - sum(lb)
    if rem < 0 or sum(ub) < total:
        return None
    counts = list(lb)
    rank = ctx.rank
    order = [k for _, k in sorted([(rank[i], k) for k, i in enumerate(nodes)])]
    g = 0
    while rem > 0 and g < len(order):
        # the next group of equal speed
        h = g
        sp = ctx.speed(nodes[order[g]])
        while h < len(order) and ctx.speed(nodes[order[h]]) == sp:
            h += 1
        group = order[g:h]
        g = h
        room = sum(ub[k] - lb[k] for k in group)
        take = min(rem, room)
        rem -= take
        if len(group) == 1:
            counts[group[0]] += take
        else:
            _water_fill(group, take, lb, ub, counts, [ctx.peers[nodes[k]].id for k in group])
    if rem > 0:
        return None
    compute = 0.0
    for k, i in enumerate(nodes):
        compute += counts[k] * ctx.speed(i)
    return compute, counts


def _water_fill(
    group: list[int], take: int, lb: list[int], ub: list[int], counts: list[int], ids: list[str]
) -> None:
    """Spread ``take`` extra layers over ``group`` so final counts are as equal as memory allows."""
    total = take + sum(lb[k] for k in group)
    by_cap = sorted(range(len(group)), key=lambda q: (ub[group[q]], ids[q]))
    left = len(by_cap)
    rest: list[int] = []
    for pos, q in enumerate(by_cap):
        k = group[q]
        share = total // left
        if ub[k] <= share:
            counts[k] = ub[k]
            total -= ub[k]
            left -= 1
        else:
            rest = by_cap[pos:]
            break
    if not rest:
        return
    base, extra = divmod(total, len(rest))
    # extras go first to stages that must hold a layer, then by peer ID
    for rank, q in enumerate(sorted(rest, key=lambda q: (-lb[group[q]], ids[q]))):
        counts[group[q]] = base + (1 if rank < extra else 0)


def cycle_latency(ctx: Ctx, cyc: Sequence[int]) -> float:
    """Sum of one-way hops around ``cyc`` and back to its first node (0 for a single node)."""
    if len(cyc) < 2:
        return 0.0
    s = 0.0
    for a, b in zip(cyc, cyc[1:], strict=False):
        s += ctx.d(a, b)
    return s + ctx.d(cyc[-1], cyc[0])


def allocate_exact(ctx: Ctx, nodes: Sequence[int], coord: int) -> tuple[float, list[int]] | None:
    """Best layer counts for ``nodes`` in ring order when layers differ in size.

    Blocks are contiguous in ring order from layer 0, the coordinator first (``nodes[0] ==
    coord``, its block may be empty), every other node holding at least one layer; each block must
    fit its peer at its layers' own sizes. Dynamic programming over (node, first layer of its
    block), O(nodes x layers^2) at worst: minimises summed compute, then the sum of squared counts
    (equal-speed peers balanced, as allocate's water-filling does). None when nothing fits.
    """
    spec = ctx.spec
    L, m = spec.n_layers, len(nodes)
    # rest[k][l]: (compute, squares, count of node k) placing layers [l, L) on nodes k..m-1
    rest: list[list[tuple[float, int, int] | None]] = [[None] * (L + 1) for _ in range(m + 1)]
    rest[m][L] = (0.0, 0, 0)
    for k in range(m - 1, -1, -1):
        i = nodes[k]
        room = ctx.peers[i].memory_bytes - (ctx.peers[i].coordinator_part(spec) if i == coord else 0)
        if room < 0:
            return None
        kv = ctx.specs[i].kv_bytes_per_layer  # at its own sessions
        act = ctx.specs[i].transient_bytes  # a block of any size runs one chunk at a time (budget.predicted_peak)
        pre = [0]  # the weights of layers [0, l), at its own width (Peer.own)
        for w in ctx.specs[i].weights:
            pre.append(pre[-1] + w)
        lo, speed = (0 if i == coord else 1), ctx.speed(i)
        disk, new = _disk_room(spec, ctx.peers[i], i == coord)
        if disk < 0:
            return None
        for start in range(L + 1):
            best: tuple[float, int, int] | None = None
            c = lo
            while (start + c <= L and pre[start + c] - pre[start] + c * kv + (act if c else 0) <= room
                   and new[start + c] - new[start] <= disk):  # fmt: skip
                after = rest[k + 1][start + c]
                if after is not None:
                    cand = (round(after[0] + c * speed, 9), after[1] + c * c, c)
                    if best is None or cand[:2] < best[:2]:
                        best = cand
                c += 1
            rest[k][start] = best
    if rest[0][0] is None:
        return None
    counts, at = [], 0
    for k in range(m):
        got = rest[k][at]
        assert got is not None
        counts.append(got[2])
        at += got[2]
    compute = 0.0
    for k, i in enumerate(nodes):
        compute += counts[k] * ctx.speed(i)
    return compute, counts


def _disk_room(spec: ModelSpec, peer: Peer, coordinator: bool) -> tuple[int | float, list[int]]:
    """(disk left for layers after the head, prefix sums of the weights it would fetch)."""
    if peer.disk_bytes is None:
        return math.inf, [0] * (spec.n_layers + 1)
    new = [0]
    for k, w in enumerate(spec.weights):
        new.append(new[-1] + (0 if k in peer.held else w))
    return peer.disk_bytes - (spec.coordinator_bytes if coordinator and not peer.held_head else 0), new
