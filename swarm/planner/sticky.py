"""Sticky re-planning: after a peer is lost (or joins), keep survivors' blocks where possible.

Theory of operation. Reloading a layer block means reading gigabytes from disk or the network, so
recovery should move only the layers that must move: those of the lost peers. Survivors keep
their blocks and their relative ring order; each hole (a maximal run of layers whose holder is
gone) is closed by the survivors on either side growing into it (if their memory allows) and/or
one spare peer (a standby or a newcomer) inserted at the hole's position. Among those options the
one with the smallest predicted traversal wins, ties going to former standbys and then by peer ID.
If the coordinator itself is gone, the peer making the traversal shortest takes over. When no
single spare can close a hole the caller falls back to a fresh plan. The caller also compares the
sticky layout with a fresh plan and takes the fresh one if it is much faster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.planner.alloc import Ctx
from swarm.planner.plan import Plan

PAIR_POOL = 24  # spares considered in pairs when closing one hole


@dataclass(frozen=True)
class Layout:
    """A placement by peer ID: coordinator, stages in order, blocks."""

    coord: str
    stages: tuple[str, ...]
    blocks: dict[str, tuple[int, int]]


def traversal(ctx: Ctx, index: dict[str, int], lay: Layout) -> tuple[float, float, list[float]]:
    """(latency, compute, hops) of coordinator -> stages... -> coordinator (self-hops are 0)."""
    path = [lay.coord, *lay.stages, lay.coord]
    hops = [ctx.lat.hop(a, b) for a, b in zip(path, path[1:], strict=False)]
    lat = 0.0
    for h in hops:
        lat += h
    compute = 0.0
    for p in lay.stages:
        s, e = lay.blocks[p]
        compute += (e - s) * ctx.peers[index[p]].ms_per_layer
    return lat, compute, hops


def layers_moved(prev: Plan, lay: Layout) -> int:
    """Layers whose holder differs between the previous plan and ``lay``."""
    moved = 0
    for p, (s, e) in lay.blocks.items():
        ps, pe = prev.blocks.get(p, (0, 0))
        moved += (e - s) - max(0, min(e, pe) - max(s, ps))
    return moved


def _cap(ctx: Ctx, i: int, is_coord: bool) -> int:
    return ctx.capc[i] if is_coord else ctx.cap[i]


def sticky_layout(ctx: Ctx, prev: Plan) -> Layout | None:
    """The previous plan with lost peers' holes closed, or None if that is not possible."""
    L = ctx.spec.n_layers
    if prev.n_layers != L:
        return None
    index = {p.id: k for k, p in enumerate(ctx.peers)}
    coord: str | None = prev.coordinator if prev.coordinator in index else None
    if coord is not None and ctx.capc[index[coord]] < 0:
        coord = None
    holder: list[str | None] = [None] * L
    for p in prev.ring:
        if p not in index:
            continue
        s, e = prev.blocks[p]
        if not ctx.fits(index[p], s, e, p == coord):
            continue  # it no longer fits (at its layers' own sizes): its layers are a hole, the peer a spare
        for layer in range(s, e):
            holder[layer] = p
    in_ring = {h for h in holder if h is not None}
    spares = [
        p.id
        for p in ctx.peers
        if p.id not in in_ring and p.id != coord and ctx.cap[index[p.id]] > 0
    ]
    former = set(prev.standbys)
    blocks: dict[str, list[int]] = {}
    for layer, h in enumerate(holder):
        if h is not None:
            blocks.setdefault(h, [layer, layer])[1] = layer + 1
    order = [p for p in prev.ring if p in blocks]
    at = 0
    while at < L:
        if holder[at] is not None:
            at += 1
            continue
        s = at
        while at < L and holder[at] is None:
            at += 1
        e = at
        a = holder[s - 1] if s > 0 else None
        b = holder[e] if e < L else None
        pred = a if a is not None else coord
        succ = b if b is not None else coord
        fill = _fill_hole(ctx, index, blocks, coord, a, b, pred, succ, e - s, spares, former)
        if fill is None:
            return None
        chain, give = fill
        ga, gb = (give.get(a, 0) if a else 0), (give.get(b, 0) if b else 0)
        if a is not None:
            blocks[a][1] += ga
        if b is not None:
            blocks[b][0] -= gb
        pos = order.index(a) + 1 if a is not None else 0
        at_layer = s + ga
        for n in chain:
            blocks[n] = [at_layer, at_layer + give[n]]
            at_layer += give[n]
            spares.remove(n)
            order.insert(pos, n)
            pos += 1
        for layer in range(s, e):
            holder[layer] = "?"  # filled
    final = {p: (blocks[p][0], blocks[p][1]) for p in order}
    if coord is None:
        best_c: tuple[tuple[float, str], Layout] | None = None
        for i, peer in enumerate(ctx.peers):
            pid = peer.id
            need = final[pid][1] - final[pid][0] if pid in final else 0
            if ctx.capc[i] < need or ctx.capc[i] < 0:
                continue
            lay = Layout(pid, tuple(order), final)
            lat, comp, _ = traversal(ctx, index, lay)
            if math.isfinite(lat) and (best_c is None or (round(lat + comp, 9), pid) < best_c[0]):
                best_c = ((round(lat + comp, 9), pid), lay)
        return None if best_c is None else best_c[1]
    lay = Layout(coord, tuple(order), final)
    lat, _, _ = traversal(ctx, index, lay)
    return lay if math.isfinite(lat) else None


def _fill_hole(
    ctx: Ctx,
    index: dict[str, int],
    blocks: dict[str, list[int]],
    coord: str | None,
    a: str | None,
    b: str | None,
    pred: str | None,
    succ: str | None,
    size: int,
    spares: list[str],
    former: set[str],
) -> tuple[list[str], dict[str, int]] | None:
    """Close a hole of ``size`` layers between stages ``a`` and ``b`` (either may be None).

    Tries the neighbours alone, with each single spare and with pairs of the fastest spares,
    keeping the cheapest; if none fits, chains spares (largest first) until the hole is covered. Returns (spares in ring order, layers
    given to each unit) or None.
    """
    hop = ctx.lat.hop

    def room(q: str) -> int:
        used = blocks[q][1] - blocks[q][0]
        return max(0, _cap(ctx, index[q], q == coord) - used)

    def split(chain: list[str]) -> tuple[float, dict[str, int]] | None:
        units = [(ctx.peers[index[q]].ms_per_layer, q, 0, room(q)) for q in (a, b) if q is not None]
        units += [(ctx.peers[index[n]].ms_per_layer, n, 1, ctx.cap[index[n]]) for n in chain]
        give = {u[1]: u[2] for u in units}
        left = size - sum(give.values())
        if left < 0:
            return None
        for _, q, lo, hi in sorted(units):
            take = min(left, hi - lo)
            give[q] += take
            left -= take
        if left > 0:
            return None
        cost = 0.0
        for speed, q, _, _ in units:
            cost += give[q] * speed
        path = [x for x in (pred, *chain, succ) if x is not None]
        for x, y in zip(path, path[1:], strict=False):
            cost += hop(x, y)
        return (cost, give) if math.isfinite(cost) else None

    best: tuple[tuple[float, int, int, str], list[str], dict[str, int]] | None = None

    def consider(chain: list[str]) -> None:
        nonlocal best
        got = split(chain)
        if got is None:
            return
        fresh = sum(1 for n in chain if n not in former)
        key = (round(got[0], 9), len(chain), fresh, ",".join(chain))
        if best is None or key < best[0]:
            best = (key, chain, got[1])

    consider([])
    for n in spares:
        consider([n])
    # two spares side by side: among the fastest few (they may beat one slow big machine)
    few = sorted(spares, key=lambda q: (ctx.peers[index[q]].ms_per_layer, q))[:PAIR_POOL]
    for n1 in few:
        for n2 in few:
            if n1 != n2:
                consider([n1, n2])
    if best is not None:
        return best[1], best[2]
    # no single spare is big enough: chain the largest ones, nearest-next from the predecessor
    by_size = sorted(
        spares, key=lambda q: (-ctx.cap[index[q]], ctx.peers[index[q]].ms_per_layer, q)
    )
    need = size - sum(room(q) for q in (a, b) if q is not None)
    picked: list[str] = []
    for q in by_size:
        if need <= 0:
            break
        picked.append(q)
        need -= ctx.cap[index[q]]
    if need > 0:
        return None
    chain, here = [], pred
    while picked:
        nxt = min(picked, key=lambda q: (hop(here, q) if here is not None else 0.0, q))
        chain.append(nxt)
        picked.remove(nxt)
        here = nxt
    got = split(chain)
    return None if got is None else (chain, got[1])
