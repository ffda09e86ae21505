"""Choosing the coordinator, the subset of peers and their ring order.

Theory of operation. The predicted time of one traversal is

    T = sum of one-way hops around  coordinator -> stage 1 -> ... -> stage n -> coordinator
      + sum over stages of layers x ms_per_layer

For a fixed set of ring nodes the hop term is the shortest directed Hamiltonian cycle over them
(the coordinator's hop to itself is 0 when it holds layers too, so it is simply one node of the
cycle) and the compute term is the greedy allocation of alloc.py. So the search is over node sets.

* Exact (<= EXACT_LIMIT peers): one Held-Karp pass per lowest member ``s`` gives the shortest
  directed cycle of every subset whose smallest index is ``s`` (O(2^n n^2) in total); every
  subset is then scored with every eligible coordinator in it. Missing edges are ``inf`` and can
  never appear in a finite cycle.
* Heuristic (more peers): screen peers cheaply (their nearest one-way hops), keep a pool of
  promising peers (each seed's nearest neighbours and the fastest machines), build a ring per
  seed coordinator by ratio-greedy insertion until the model fits, then improve it by first-
  improvement local search (insert, remove, replace, change coordinator, 2-opt, Or-opt). A final
  ring of <= EXACT_LIMIT nodes is re-solved exactly over its own nodes.

Fewer bytes moved (issue 25). When peers say what they hold on disk or how much disk they have,
speed still comes first: among the placements predicted within MOVE_TOLERANCE of the fastest one
that every peer's disk can take, the one that makes peers fetch the fewest bytes wins (layers not
held by their new holder, and the head if the coordinator lacks it). The pool is the search's
winners, the near-best placements of the exact search, and each of their rings turned to start at
every member and run either way (which puts a holder's layers on it when speeds tie). Without
such peers nothing of this runs and plans are exactly as before.

Determinism: peers are indexed in sorted-ID order, loops run in index order, and ties between
equal costs (rounded to 1e-9 ms) are broken by the coordinator's ID, then the members' IDs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from swarm.planner.alloc import Ctx, allocate, cycle_latency

EXACT_LIMIT = 10
MOVE_TOLERANCE = 0.05  # placements within 5 % of the fastest count as tied: fewest bytes moved wins
NEAR_KEPT = 64  # near-best placements of the exact search considered for fewer bytes moved
POOL_ALL_UPTO = 40  # heuristic: below this many peers every peer is in the pool
INF = math.inf


@dataclass(frozen=True)
class Candidate:
    """A complete placement: cycle of node indices starting at the coordinator, layer counts."""

    latency: float
    compute: float
    coord: int
    cyc: tuple[int, ...]  # cyc[0] == coord
    counts: tuple[int, ...]  # aligned with cyc; counts[0] may be 0 (layer-less coordinator)

    @property
    def cost(self) -> float:
        return self.latency + self.compute

    @property
    def n_stages(self) -> int:
        return sum(1 for c in self.counts if c > 0)

    def key(self, ctx: Ctx) -> tuple[float, int, str, tuple[str, ...]]:
        ids = tuple(sorted(ctx.peers[i].id for i in self.cyc))
        return (round(self.cost, 9), self.n_stages, ctx.peers[self.coord].id, ids)


def evaluate(ctx: Ctx, cyc: Sequence[int]) -> Candidate | None:
    """Score the cycle ``cyc`` with ``cyc[0]`` as coordinator; None if it cannot hold the model."""
    coord = cyc[0]
    if ctx.capc[coord] < 0:
        return None
    lat = cycle_latency(ctx, cyc)
    if lat == INF:
        return None
    got = allocate(ctx, cyc, coord)
    if got is None:
        return None
    compute, counts = got
    if counts[0] == 0 and len(cyc) == 1:
        return None
    return Candidate(lat, compute, coord, tuple(cyc), tuple(counts))


def better(ctx: Ctx, a: Candidate | None, b: Candidate | None) -> bool:
    """Whether ``a`` beats ``b`` (None loses to anything)."""
    if a is None:
        return False
    return b is None or a.key(ctx) < b.key(ctx)


def moved_bytes(ctx: Ctx, cand: Candidate) -> int | None:
    """Bytes ``cand`` makes its peers fetch (layers they do not hold, the head if the coordinator
    lacks it); None if some peer's disk budget cannot take its share."""
    spec, at, total = ctx.spec, 0, 0
    for i, c in zip(cand.cyc, cand.counts, strict=True):
        p, coord = ctx.peers[i], i == cand.coord
        if not p.stores(spec, at, at + c, coordinator=coord):
            return None
        total += p.moved_bytes(spec, at, at + c, coordinator=coord)
        at += c
    return total


def fewest_moves(
    ctx: Ctx, options: Sequence[Candidate], score: Callable[[list[int]], Candidate | None]
) -> Candidate | None:
    """Speed first, then bytes moved: of ``options`` and their rings turned and reversed (scored
    by ``score``), those every disk can take and predicted within MOVE_TOLERANCE of the fastest of
    them; of those the one moving the fewest bytes (ties: the usual key). None if no disk fits."""
    seen: set[tuple[int, ...]] = set()
    pool: list[tuple[Candidate, int]] = []
    for cand in options:
        back = (cand.cyc[0], *cand.cyc[:0:-1])
        for ring in (cand.cyc, back):
            for r in range(len(ring)):
                cyc = ring[r:] + ring[:r]
                if cyc in seen:
                    continue
                seen.add(cyc)
                got = cand if cyc == cand.cyc else score(list(cyc))
                moved = None if got is None else moved_bytes(ctx, got)
                if got is not None and moved is not None:
                    pool.append((got, moved))
    if not pool:
        return None
    fastest = min(c.cost for c, _ in pool)
    near = [(m, c.key(ctx), c.cyc, c) for c, m in pool if c.cost <= fastest * (1.0 + MOVE_TOLERANCE) + 1e-9]
    return min(near, key=lambda t: t[:3])[3]


# ----------------------------------------------------------------------------- exact


def solve_exact(
    ctx: Ctx, nodes: Sequence[int], near: list[Candidate] | None = None
) -> tuple[Candidate | None, dict[int, Candidate]]:
    """The optimum over every subset, order and coordinator of ``nodes`` (at most ~12 of them).

    Returns the best candidate and the best one for each number of stages (for the "fewer peers
    would be faster" note). ``near``, if given, gets the placements within MOVE_TOLERANCE of the
    best (at most NEAR_KEPT, fastest first), for fewest_moves.
    """
    m = len(nodes)
    D = [[ctx.d(a, b) for b in nodes] for a in nodes]
    full = 1 << m
    cyc_cost = [INF] * full
    cyc_end = [-1] * full
    parents: list[list[list[int]]] = []  # per start s: parent[sub][j]
    for s in range(m):
        width = m - s - 1
        nsub = 1 << width
        dp = [[INF] * m for _ in range(nsub)]
        par = [[-1] * m for _ in range(nsub)]
        dp[0][s] = 0.0
        cyc_cost[1 << s] = 0.0
        cyc_end[1 << s] = s
        for sub in range(nsub):
            row = dp[sub]
            mask = (1 << s) | (sub << (s + 1))
            best_close, best_j = INF, -1
            for j in range(s, m):
                cj = row[j]
                if cj == INF:
                    continue
                if j != s:
                    close = cj + D[j][s]
                    if close < best_close:
                        best_close, best_j = close, j
                Dj = D[j]
                for k in range(s + 1, m):
                    if mask >> k & 1:
                        continue
                    c = cj + Dj[k]
                    nsub_k = sub | (1 << (k - s - 1))
                    if c < dp[nsub_k][k]:
                        dp[nsub_k][k] = c
                        par[nsub_k][k] = j
            if sub:
                cyc_cost[mask] = best_close
                cyc_end[mask] = best_j
        parents.append(par)

    def path(mask: int) -> list[int]:
        s = (mask & -mask).bit_length() - 1
        j = cyc_end[mask]
        sub = mask >> (s + 1)
        seq = []
        while j != s:
            seq.append(j)
            pj = parents[s][sub][j]
            sub &= ~(1 << (j - s - 1))
            j = pj
        seq.append(s)
        return seq[::-1]

    best: Candidate | None = None
    by_stages: dict[int, Candidate] = {}
    best_mask: dict[int, int] = {}
    # layers a node set can hold at most (as plain stages, plus the best coordinator bonus)
    cap_sum = [0] * full
    for mask in range(1, full):
        low = (mask & -mask).bit_length() - 1
        cap_sum[mask] = cap_sum[mask & (mask - 1)] + max(0, ctx.cap[nodes[low]])
    bonus = max(0, max((ctx.capc[i] - max(0, ctx.cap[i]) for i in nodes), default=0))
    kept: list[tuple[Candidate, int]] = []
    for mask in range(1, full):
        lat = cyc_cost[mask]
        if lat == INF or cap_sum[mask] + bonus < ctx.spec.n_layers:
            continue
        members = [nodes[b] for b in range(m) if mask >> b & 1]
        for c in members:
            if ctx.capc[c] < 0:
                continue
            order = [c] + [x for x in members if x != c]
            got = allocate(ctx, order, c)
            if got is None or (got[1][0] == 0 and len(order) == 1):
                continue
            # placeholder order; the real cycle order is rebuilt for winners only
            cand = Candidate(lat, got[0], c, tuple(order), tuple(got[1]))
            if near is not None:
                kept.append((cand, mask))
            k = cand.n_stages
            if better(ctx, cand, by_stages.get(k)):
                by_stages[k] = cand
                best_mask[k] = mask

    def rebuilt(cand: Candidate, mask: int) -> Candidate:
        """``cand`` in its real cycle order (the order above is a placeholder)."""
        seq = [nodes[b] for b in path(mask)]
        r = seq.index(cand.coord)
        cyc = seq[r:] + seq[:r]
        counts = dict(zip(cand.cyc, cand.counts, strict=True))
        return Candidate(cycle_latency(ctx, cyc), cand.compute, cand.coord, tuple(cyc), tuple(counts[x] for x in cyc))

    for k, cand in list(by_stages.items()):
        by_stages[k] = rebuilt(cand, best_mask[k])
    for cand in by_stages.values():
        if better(ctx, cand, best):
            best = cand
    if near is not None and best is not None:
        within = best.cost * (1.0 + MOVE_TOLERANCE) + 1e-9
        nearby = sorted(((c.key(ctx), c.cyc, mask, c) for c, mask in kept if c.cost <= within), key=lambda t: t[:3])
        near.extend(rebuilt(c, mask) for _, _, mask, c in nearby[:NEAR_KEPT])
    return best, by_stages


# ----------------------------------------------------------------------------- heuristic


def screen(ctx: Ctx, eligible: Sequence[int], seeds_n: int = 4) -> tuple[list[int], list[int]]:
    """Pick seed coordinators and the pool of peers the local search may use."""
    spec = ctx.spec
    caps = sorted(ctx.cap[i] for i in eligible if ctx.cap[i] > 0)
    med = caps[len(caps) // 2] if caps else 1
    k_est = max(1, min(EXACT_LIMIT, -(-spec.n_layers // max(1, med))))
    coords = [i for i in eligible if ctx.capc[i] >= 0]

    def proxy(i: int) -> float:
        vals = ctx.lat.smallest_out(ctx.peers[i].id, k_est + 1)
        return sum(vals) if len(vals) >= k_est else INF

    scored = sorted(coords, key=lambda i: (proxy(i), ctx.peers[i].id))
    fastest = sorted(
        (i for i in eligible if ctx.cap[i] > 0),
        key=lambda i: (ctx.speed(i), -ctx.cap[i], ctx.peers[i].id),
    )
    seeds: list[int] = []
    for i in scored[:seeds_n] + [i for i in fastest if ctx.capc[i] >= 0][:2]:
        if i not in seeds:
            seeds.append(i)
    if len(eligible) <= POOL_ALL_UPTO:
        return seeds, list(eligible)
    ids = [ctx.peers[i].id for i in eligible]
    index = {ctx.peers[i].id: i for i in eligible}
    pool: set[int] = set(seeds)
    for s in seeds:
        pool.update(index[p] for p in ctx.lat.nearest(ctx.peers[s].id, ids, 12))
    pool.update(fastest[:10])
    return seeds, sorted(pool)


def _insert_delta(ctx: Ctx, cyc: Sequence[int], p: int) -> tuple[float, int]:
    """Cheapest place to insert ``p`` after position 0..len-1 (never before the coordinator)."""
    best, at = INF, -1
    n = len(cyc)
    for pos in range(n):
        a, b = cyc[pos], cyc[(pos + 1) % n]
        delta = ctx.d(a, p) + ctx.d(p, b) - (ctx.d(a, b) if n > 1 else 0.0)
        if delta < best:
            best, at = delta, pos + 1
    return best, at


def construct(ctx: Ctx, pool: Sequence[int], seed: int) -> list[int] | None:
    """Ratio-greedy insertion from ``seed`` until the model fits."""
    cyc = [seed]
    need = ctx.spec.n_layers - max(0, ctx.capc[seed])
    while need > 0:
        best: tuple[float, str] | None = None
        pick = None
        for p in pool:
            if p in cyc or ctx.cap[p] <= 0:
                continue
            delta, at = _insert_delta(ctx, cyc, p)
            if delta == INF:
                continue
            gain = min(ctx.cap[p], need)
            score = ((delta + ctx.speed(p) * gain) / gain, ctx.peers[p].id)
            if best is None or score < best:
                best, pick = score, (p, at)
        if pick is None:
            return None
        cyc.insert(pick[1], pick[0])
        need -= min(ctx.cap[pick[0]], need)
    return cyc


def _neighbours(cyc: list[int], pool: Sequence[int], ctx: Ctx) -> Iterator[list[int]]:
    """Every move of the local search, in a fixed order (lazily: the search stops at the first gain)."""
    n = len(cyc)
    inside = set(cyc)
    for pos in range(1, n):  # remove a stage
        yield cyc[:pos] + cyc[pos + 1 :]
    for pos in range(1, n):  # change coordinator to another ring node
        if ctx.capc[cyc[pos]] >= 0:
            yield cyc[pos:] + cyc[:pos]
    for p in pool:
        if p in inside:
            continue
        _, at = _insert_delta(ctx, cyc, p)
        if at > 0:
            yield cyc[:at] + [p] + cyc[at:]
        if ctx.capc[p] >= 0:
            yield [p] + cyc  # a new coordinator in front, old one becomes a stage
        for pos in range(n):  # replace (pos 0: a new coordinator)
            yield cyc[:pos] + [p] + cyc[pos + 1 :]
    for i in range(1, n - 1):  # 2-opt: reverse cyc[i..j]
        for j in range(i + 1, n):
            yield cyc[:i] + cyc[i : j + 1][::-1] + cyc[j + 1 :]
    for i in range(1, n):  # Or-opt: move one stage elsewhere
        rest = cyc[:i] + cyc[i + 1 :]
        for j in range(1, n):
            if j != i:
                yield rest[:j] + [cyc[i]] + rest[j:]


def local_search(
    ctx: Ctx, pool: Sequence[int], cyc: list[int], max_rounds: int = 200
) -> Candidate | None:
    """First-improvement descent from ``cyc`` (which must be feasible to start)."""
    cur = evaluate(ctx, cyc)
    if cur is None:
        return None
    for _ in range(max_rounds):
        improved = False
        for nb in _neighbours(list(cur.cyc), pool, ctx):
            cand = evaluate(ctx, nb)
            if cand is not None and cand.cost < cur.cost - 1e-9:
                cur, improved = cand, True
                break
        if not improved:
            break
    return cur


def solve_heuristic(ctx: Ctx, eligible: Sequence[int]) -> tuple[Candidate | None, Candidate | None]:
    """Best candidate found, and the best one found with more stages (for the note)."""
    seeds, pool = screen(ctx, eligible)
    best: Candidate | None = None
    for seed in seeds:
        start = construct(ctx, pool, seed)
        if start is None:
            continue
        cand = local_search(ctx, pool, start)
        if better(ctx, cand, best):
            best = cand
    # a single machine that holds everything is a candidate too
    for i in eligible:
        if ctx.capc[i] >= ctx.spec.n_layers:
            cand = evaluate(ctx, [i])
            if better(ctx, cand, best):
                best = cand
    if best is not None and len(best.cyc) <= EXACT_LIMIT:
        exact, _ = solve_exact(ctx, sorted(best.cyc))
        if better(ctx, exact, best):
            best = exact
    more: Candidate | None = None
    if best is not None:
        for p in pool:
            if p in best.cyc:
                continue
            _, at = _insert_delta(ctx, list(best.cyc), p)
            if at <= 0:
                continue
            cand = evaluate(ctx, list(best.cyc[:at]) + [p] + list(best.cyc[at:]))
            if cand is not None and cand.n_stages > best.n_stages and better(ctx, cand, more):
                more = cand
    return best, more
