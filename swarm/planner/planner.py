"""``plan()``: the one entry point. Validates, searches, explains failures, re-plans stickily."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from swarm.errors import PlanningError, UsageError
from swarm.planner.alloc import Ctx
from swarm.planner.plan import Plan, check_blocks
from swarm.planner.search import EXACT_LIMIT, Candidate, solve_exact, solve_heuristic
from swarm.planner.spec import GB, Latency, ModelSpec, Peer
from swarm.planner.sticky import Layout, layers_moved, sticky_layout, traversal


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
    exists, saying how many GB are missing or which peers cannot reach each other.
    """
    seen: set[str] = set()
    for p in peers:
        if p.id in seen:
            raise UsageError(f"peer {p.id} is listed twice")
        seen.add(p.id)
    if not peers:
        raise PlanningError("no peers: a plan needs at least one peer")
    lat = rtt_ms if isinstance(rtt_ms, Latency) else Latency(rtt_ms, one_way_ms)
    ctx = Ctx.build(spec, peers, lat)
    _check_memory(ctx)
    if epoch is None:
        epoch = previous.epoch + 1 if previous is not None else 0

    eligible = [i for i in range(ctx.n) if ctx.cap[i] > 0 or ctx.capc[i] >= 0]
    more: Candidate | None
    if len(eligible) <= exact_limit:
        best, by_stages = solve_exact(ctx, eligible)
        more = None
        for k in sorted(by_stages):
            if best is not None and k > best.n_stages:
                cand = by_stages[k]
                if more is None or cand.key(ctx) < more.key(ctx):
                    more = cand
    else:
        best, more = solve_heuristic(ctx, eligible)
    if best is None:
        raise PlanningError(_unreachable_message(ctx, eligible))
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
        raise PlanningError(
            f"no peer can be coordinator: it needs {spec.coordinator_bytes / GB:.2f} GB for the "
            f"embedding, head and draft model, but the largest coordinator-capable peer offers "
            f"{top / GB:.2f} GB: {(spec.coordinator_bytes - top) / GB:.2f} GB short"
        )
    plain = sum(max(0, c) for c in ctx.cap)
    best_layers = max(plain - max(0, ctx.cap[i]) + ctx.capc[i] for i in coords)
    if best_layers >= spec.n_layers:
        return
    bpl = spec.bytes_per_layer
    offered = sum(p.memory_bytes for p in ctx.peers)
    short = max(spec.total_bytes - offered, (spec.n_layers - best_layers) * bpl)
    raise PlanningError(
        f"not enough memory: the model needs {spec.total_bytes / GB:.2f} GB ({spec.n_layers} layers "
        f"x {bpl / GB:.3f} GB incl. KV for {spec.context_tokens} tokens, + "
        f"{spec.coordinator_bytes / GB:.2f} GB on the coordinator) but the {ctx.n} peers offer "
        f"{offered / GB:.2f} GB and fit only {best_layers} whole layers: {short / GB:.2f} GB short"
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
