"""``plan()``: the one entry point. Validates, searches, explains failures, re-plans stickily."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from swarm.errors import PlanningError, UsageError
from swarm.planner.alloc import Ctx, allocate_exact, cycle_latency
from swarm.planner.plan import Plan, check_blocks
from swarm.planner.search import (
    EXACT_LIMIT,
    Candidate,
    better,
    evaluate,
    fewest_moves,
    solve_exact,
    solve_heuristic,
)
from swarm.planner.spec import GB, Latency, ModelSpec, Peer
from swarm.planner.sticky import Layout, layers_moved, sticky_layout, traversal

# Tokens a drafting coordinator is expected to commit per traversal when the planner compares a
# ring with a draft to one without (Shard's figure, REFERENCE.md; the coordinator's own policy
# then adapts to what it measures): only the planner's choice of where the coordinator sits uses it.
DRAFT_TOKENS_PER_TRAVERSAL = 3.0


def plan(
    spec: ModelSpec,
    peers: Sequence[Peer],
    rtt_ms: Mapping[str, Mapping[str, float]] | Latency,
    *,
    one_way_ms: Mapping[str, Mapping[str, float]] | None = None,
    previous: Plan | None = None,
    epoch: int | None = None,
    sticky_tolerance: float = 0.25,
    exact_limit: int = EXACT_LIMIT,
) -> Plan:
    """Place ``spec`` on ``peers``: coordinator, ring order, blocks, predicted speed.

    Pure and deterministic: the same inputs (in any order) give the same plan on every peer.
    With ``previous`` the plan is sticky: survivors keep their blocks, holes go to neighbours or
    spares, unless a fresh plan is faster by more than ``sticky_tolerance`` (0.25 = 25 %).
    ``epoch`` defaults to ``previous.epoch + 1`` (or 0). Raises PlanningError when no placement
    exists, saying how many GB are missing, which peers cannot reach each other, or that the
    peers' disk budgets cannot take the layers they do not hold.

    Disks (``Peer.held``, ``held_head``, ``disk_bytes``): no block goes where the disk budget cannot
    take what its peer must fetch of it, and among placements about as fast as the fastest
    (search.MOVE_TOLERANCE) the one moving the fewest bytes wins (search.fewest_moves).

    Drafts: a peer that holds a draft model (``Peer.draft_ms``) budgets its bytes when it
    coordinates. When some peers hold one, the best ring whose coordinator is one of them is
    compared with the best ring overall by predicted ms per token: ``max(traversal /
    DRAFT_TOKENS_PER_TRAVERSAL, draft_ms)`` with a draft, the traversal without; the faster wins
    (on a slow WAN ring the draft's coordinator, on a fast LAN the centroid) and the note says so.
    """
    kw = dict(one_way_ms=one_way_ms, previous=previous, epoch=epoch, sticky_tolerance=sticky_tolerance,
              exact_limit=exact_limit)  # fmt: skip
    drafted = {p.id: p.draft_ms for p in peers if p.draft_ms is not None and p.coordinator_ok}
    if not drafted:
        return _plan(spec, peers, rtt_ms, **kw)  # type: ignore[arg-type]
    try:
        best = _plan(spec, peers, rtt_ms, **kw)  # type: ignore[arg-type]
    except PlanningError:
        if fits(spec, peers):
            raise  # not for want of memory (an RTT not measured yet): the caller tries again later
        # no room for a draft where a coordinator must be: coordinate without one
        bare = [dataclasses.replace(p, draft_ms=None, draft_bytes=0) for p in peers]
        plain = _plan(spec, bare, rtt_ms, **kw)  # type: ignore[arg-type]
        why = "no coordinator has memory for its draft model next to its share of the layers"
        return dataclasses.replace(plain, note=f"{plain.note}; {why}" if plain.note else why)
    if best.coordinator in drafted:
        return dataclasses.replace(best, draft=True)
    only = [p if p.id in drafted else dataclasses.replace(p, coordinator_ok=False) for p in peers]
    try:
        alt = _plan(spec, only, rtt_ms, **kw)  # type: ignore[arg-type]
    except PlanningError:
        return best
    with_draft = max(alt.predicted_traversal_ms / DRAFT_TOKENS_PER_TRAVERSAL, drafted[alt.coordinator])
    if with_draft >= best.predicted_traversal_ms:
        return best
    why = (
        f"coordinator {alt.coordinator} holds a draft model: predicted {with_draft:.1f} ms per token "
        f"against {best.predicted_traversal_ms:.1f} ms without a draft at {best.coordinator}"
    )
    return dataclasses.replace(alt, draft=True, note=f"{alt.note}; {why}" if alt.note else why)


def fits(spec: ModelSpec, peers: Sequence[Peer]) -> bool:
    """Whether the peers' memory holds the model (coordinators with their drafts), reachability aside."""
    try:
        _check_memory(Ctx.build(spec, peers, Latency({})))
    except PlanningError:
        return False
    return True


def _plan(
    spec: ModelSpec,
    peers: Sequence[Peer],
    rtt_ms: Mapping[str, Mapping[str, float]] | Latency,
    *,
    one_way_ms: Mapping[str, Mapping[str, float]] | None,
    previous: Plan | None,
    epoch: int | None,
    sticky_tolerance: float,
    exact_limit: int,
) -> Plan:
    seen: set[str] = set()
    for p in peers:
        if p.id in seen:
            raise UsageError(f"peer {p.id} is listed twice")
        seen.add(p.id)
    if not peers:
        raise PlanningError("no peers: a plan needs at least one peer")
    lat = rtt_ms if isinstance(rtt_ms, Latency) else Latency(rtt_ms, one_way_ms)
    ctx = Ctx.build(spec, peers, lat)  # every layer counted at the largest one's size: always safe
    if epoch is None:
        epoch = previous.epoch + 1 if previous is not None else 0
    try:
        best, more = _fresh(ctx, peers, lat, exact_limit)
    except PlanningError:
        disks = [p for p in peers if p.disk_bytes is not None]
        unbounded = [dataclasses.replace(p, disk_bytes=None) for p in peers]
        if disks and _finds(Ctx.build(spec, unbounded, lat), unbounded, lat, exact_limit):
            raise PlanningError(_disk_message(spec, disks)) from None  # memory would do: the disks do not
        raise
    fresh = _layout(ctx, best)
    chosen, moved = fresh, 0
    index = {p.id: k for k, p in enumerate(ctx.peers)}
    if previous is not None:
        moved = layers_moved(previous, fresh)
        sticky = sticky_layout(ctx, previous)
        if sticky is not None:
            s_lat, s_comp, _ = traversal(ctx, index, sticky)
            if s_lat + s_comp <= best.cost * (1.0 + sticky_tolerance) + 1e-9:
                chosen, moved = sticky, layers_moved(previous, sticky)
    note = _note(ctx, best, more) if chosen is fresh else None
    return _to_plan(ctx, index, chosen, epoch, moved, note)


def _finds(ctx: Ctx, peers: Sequence[Peer], lat: Latency, exact_limit: int) -> bool:
    try:
        _fresh(ctx, peers, lat, exact_limit)
    except PlanningError:
        return False
    return True


def _fresh(
    ctx: Ctx, peers: Sequence[Peer], lat: Latency, exact_limit: int
) -> tuple[Candidate, Candidate | None]:
    """The fresh placement and the best with more stages (for the note); PlanningError if none."""
    spec = ctx.spec
    held = any(p.held or p.held_head or p.disk_bytes is not None for p in peers)
    near: list[Candidate] | None = [] if held else None
    if spec.uniform:
        _check_memory(ctx)
        best, more = _search(ctx, exact_limit, near)
    else:
        relaxed = Ctx.build(spec, peers, lat, smallest=True)
        best, more = _search_by_layer(ctx, relaxed, exact_limit, near)
    if best is None:
        raise PlanningError(_unreachable_message(ctx, [i for i in range(ctx.n) if ctx.cap[i] > 0 or ctx.capc[i] >= 0]))
    if near is not None:
        # speed first, then fewer bytes moved (the search's winners, turned and reversed)
        options = [best, *([more] if more is not None else []), *near]
        got = fewest_moves(ctx, options, (lambda cyc: evaluate(ctx, cyc)) if spec.uniform
                           else (lambda cyc: _exact_counts(ctx, cyc)))  # fmt: skip
        if got is None:
            raise PlanningError(_disk_message(spec, [p for p in peers if p.disk_bytes is not None]))
        best = got
        more = more if more is not None and more.n_stages > best.n_stages else None
    return best, more


def _exact_counts(ctx: Ctx, cyc: list[int]) -> Candidate | None:
    """``cyc`` scored with exact counts for layers of different sizes (None: it cannot hold them)."""
    if not ctx.peers[cyc[0]].coordinator_ok:
        return None
    lat = cycle_latency(ctx, cyc)
    got = allocate_exact(ctx, cyc, cyc[0])
    if not math.isfinite(lat) or got is None or (got[1][0] == 0 and len(cyc) == 1):
        return None
    return Candidate(lat, got[0], cyc[0], tuple(cyc), tuple(got[1]))


def _disk_message(spec: ModelSpec, disks: Sequence[Peer]) -> str:
    budgets = ", ".join(f"{p.id} {p.disk_bytes / GB:.2f} GB" for p in sorted(disks, key=lambda p: p.id)[:12]
                        if p.disk_bytes is not None)  # fmt: skip
    return (
        f"not enough disk: memory would hold the model, but no placement fits the peers' disk budgets "
        f"for the layers they do not hold yet ({sum(spec.weights) / GB:.2f} GB of layers + "
        f"{spec.coordinator_bytes / GB:.2f} GB on the coordinator; free disk: {budgets}): "
        "raise --disk on a peer, or add peers"
    )


def _candidates(
    ctx: Ctx, exact_limit: int, near: list[Candidate] | None = None
) -> tuple[Candidate | None, list[Candidate]]:
    """The search's best placement and the alternatives it kept (the best per stage count, or the
    best with more stages), on ``ctx``'s capacities; ``near`` as solve_exact."""
    eligible = [i for i in range(ctx.n) if ctx.cap[i] > 0 or ctx.capc[i] >= 0]
    if len(eligible) <= exact_limit:
        best, by_stages = solve_exact(ctx, eligible, near)
        return best, list(by_stages.values())
    best, more = solve_heuristic(ctx, eligible)
    return best, [c for c in (best, more) if c is not None]


def _with_more(ctx: Ctx, best: Candidate | None, options: Sequence[Candidate]) -> tuple[Candidate | None, Candidate | None]:
    """(best, the best option with more stages than it: what the note compares against)."""
    more: Candidate | None = None
    for cand in options:
        if best is not None and cand.n_stages > best.n_stages and (more is None or cand.key(ctx) < more.key(ctx)):
            more = cand
    return best, more


def _search(
    ctx: Ctx, exact_limit: int, near: list[Candidate] | None = None
) -> tuple[Candidate | None, Candidate | None]:
    best, options = _candidates(ctx, exact_limit, near)
    if near is not None:
        near.extend(options)
    return _with_more(ctx, best, options)


def _search_by_layer(
    ctx: Ctx, relaxed: Ctx, exact_limit: int, near: list[Candidate] | None = None
) -> tuple[Candidate | None, Candidate | None]:
    """Layers of different sizes: blocks are budgeted at their own layers' sizes.

    The search works on whole-layer capacities, so it runs twice: counting every layer at the
    smallest size (a relaxation: it finds every ring that could hold the model, and some that
    cannot) and at the largest (whatever it finds fits). Each ring either search proposes gets
    exact counts for its order (alloc.allocate_exact, each block at its layers' own sizes) or is
    dropped; the best that fits wins. Never worse than budgeting every layer at the largest size.
    """
    _check_memory(relaxed)  # a necessary condition, with the usual message
    options: list[Candidate] = []
    seen: set[tuple[int, ...]] = set()
    for c in (ctx, relaxed):
        top, kept = _candidates(c, exact_limit)
        for cand in [top, *kept]:
            if cand is None:
                continue
            # the same ring with each of its members as coordinator (the first block's holder):
            # which one can carry the coordinator part depends on the sizes of the layers it gets
            for r in range(len(cand.cyc)):
                cyc = cand.cyc[r:] + cand.cyc[:r]
                if cyc in seen or ctx.capc[cyc[0]] < 0 and relaxed.capc[cyc[0]] < 0:
                    continue
                seen.add(cyc)
                got = allocate_exact(c, cyc, cyc[0])
                if got is not None and not (got[1][0] == 0 and len(cyc) == 1):
                    options.append(Candidate(cand.latency, got[0], cyc[0], cyc, tuple(got[1])))
    chosen: Candidate | None = None
    for cand in options:
        if better(ctx, cand, chosen):
            chosen = cand
    if chosen is None:
        raise PlanningError(_short_message(ctx))
    if near is not None:
        near.extend(options)
    return _with_more(ctx, chosen, options)


def _layout(ctx: Ctx, cand: Candidate) -> Layout:
    ids = [ctx.peers[i].id for i in cand.cyc]
    stages = [(pid, c) for pid, c in zip(ids, cand.counts, strict=True) if c > 0]
    blocks: dict[str, tuple[int, int]] = {}
    at = 0
    for pid, c in stages:
        blocks[pid] = (at, at + c)
        at += c
    return Layout(ids[0], tuple(pid for pid, _ in stages), blocks)


def _to_plan(
    ctx: Ctx, index: dict[str, int], lay: Layout, epoch: int, moved: int, note: str | None
) -> Plan:
    lat, comp, hops = traversal(ctx, index, lay)
    used = set(lay.stages) | {lay.coord}
    plan = Plan(
        epoch=epoch,
        n_layers=ctx.spec.n_layers,
        coordinator=lay.coord,
        ring=lay.stages,
        blocks={p: lay.blocks[p] for p in lay.stages},
        standbys=tuple(p.id for p in ctx.peers if p.id not in used),
        predicted_latency_ms=lat,
        predicted_compute_ms=comp,
        layers_moved=moved,
        note=note,
        hops_ms=tuple(hops),
    )
    check_blocks(plan)
    return plan


def _note(ctx: Ctx, best: Candidate, more: Candidate | None) -> str | None:
    """Say so when more peers are available but using them would be slower."""
    if more is None:
        return None
    k = best.n_stages
    if k == 1:
        who = ctx.peers[best.cyc[0] if best.counts[0] > 0 else best.cyc[1]].id
        return (
            f"one peer ({who}) holds the whole model: {best.cost:.1f} ms per token; the best ring "
            f"over {more.n_stages} peers would take {more.cost:.1f} ms"
        )
    return (
        f"{k} stages give the fastest ring ({best.cost:.1f} ms per token); using more peers is "
        f"slower (best with {more.n_stages} stages: {more.cost:.1f} ms)"
    )


def _check_memory(ctx: Ctx) -> None:
    spec = ctx.spec
    coords = [i for i in range(ctx.n) if ctx.capc[i] >= 0]
    if not coords:
        ok = [p for p in ctx.peers if p.coordinator_ok]
        if not ok:
            raise PlanningError(
                "no peer may be coordinator (coordinator_ok is false for every peer)"
            )
        top = max(p.memory_bytes for p in ok)
        need = spec.coordinator_at(spec.sessions)  # as Peer.coordinator_part counts it
        raise PlanningError(
            f"no peer can be coordinator: it needs {need / GB:.2f} GB for the embedding, head, "
            f"draft model and {_sessions_phrase(spec)} in flight (results waiting for the head, "
            f"logits), but the largest coordinator-capable peer offers "
            f"{top / GB:.2f} GB: {(need - top) / GB:.2f} GB short"
        )
    plain = sum(max(0, c) for c in ctx.cap)
    best_layers = max(plain - max(0, ctx.cap[i]) + ctx.capc[i] for i in coords)
    if best_layers >= spec.n_layers:
        return
    bpl = ctx.per_layer
    offered = sum(p.memory_bytes for p in ctx.peers)
    short = max(spec.total_bytes - offered, (spec.n_layers - best_layers) * bpl)
    raise PlanningError(
        f"not enough memory: the model needs {spec.total_bytes / GB:.2f} GB ({_layers_phrase(spec)} incl. "
        f"KV for {_sessions_phrase(spec)}, + {spec.coordinator_bytes / GB:.2f} GB on the coordinator) "
        f"but the {ctx.n} peers offer {offered / GB:.2f} GB and fit only {best_layers} whole layers: "
        f"{short / GB:.2f} GB short"
    )


def _sessions_phrase(spec: ModelSpec) -> str:
    one = f"{spec.context_tokens} tokens"
    return one if spec.sessions == 1 else f"{spec.sessions} sessions of {one}"


def _layers_phrase(spec: ModelSpec) -> str:
    if spec.uniform:
        return f"{spec.n_layers} layers x {spec.bytes_per_layer / GB:.3f} GB"
    return (f"{spec.n_layers} layers of {spec.smallest_bytes_per_layer / GB:.3f} to "
            f"{spec.bytes_per_layer / GB:.3f} GB")


def _short_message(ctx: Ctx) -> str:
    """No ring holds the model at its layers' own sizes (though the offered total might)."""
    spec = ctx.spec
    offered = sum(p.memory_bytes for p in ctx.peers)
    return (
        f"not enough memory: the model needs {spec.total_bytes / GB:.2f} GB ({_layers_phrase(spec)} incl. KV "
        f"for {_sessions_phrase(spec)}, + {spec.coordinator_bytes / GB:.2f} GB on the coordinator); the "
        f"{ctx.n} peers offer {offered / GB:.2f} GB, but no split of the layers into contiguous blocks fits them"
    )


def _unreachable_message(ctx: Ctx, eligible: Sequence[int]) -> str:
    pairs = []
    for x, i in enumerate(eligible):
        for j in eligible[x + 1 :]:
            if math.isinf(ctx.d(i, j)) or math.isinf(ctx.d(j, i)):
                pairs.append(f"{ctx.peers[i].id} <-> {ctx.peers[j].id}")
    shown = ", ".join(pairs[:12]) + (f" and {len(pairs) - 12} more" if len(pairs) > 12 else "")
    if not pairs:
        return "no ring found that holds the model (no missing edges; the search gave up)"
    return (
        "no ring without missing edges can hold the model; these peers cannot reach each other "
        f"(no RTT measured in either direction): {shown}"
    )
