"""The web console: the ring, its speed and its life, live in a browser, from the API's own port.

Theory of operation
-------------------
Routes (added to the endpoint's app by ``console_routes``): ``GET /`` the console page, ``GET
/chat`` the chat page, ``GET /static/console/{file}`` their assets (all shipped in the package,
beside this module: no CDN, no build step), and the data: ``GET /console/feed`` (server-sent
events) and ``GET /console/feed/state`` (one snapshot, JSON). The data routes sit behind the
API's bearer token (server.py ``PROTECTED``); the pages and assets hold no data, and the page
sends the token with ``fetch`` (an ``EventSource`` cannot send a header), so it never travels in
a URL or a log.

The feed asks the backend for the serving coordinator's status (the same dict ``shard-swarm
status`` shows, swarm/node/generation/report.py), at most once per FEED_INTERVAL_S however many pages
watch, and only while one does: a closed page costs the node nothing. Each status becomes a
*state* (the ring as ``build_view`` sees it, plus what a traversal's time goes to, the speed
history, the sessions and queue) and, through a :class:`Timeline`, *events*: joins, leaves,
suspicions, re-plans with their cause and pause, new rings. Both go down as ``data:`` lines
of JSON with a ``type``. Only names and numbers are sent: the status dict holds no secret nor
key, and the page renders every member-supplied string as text (``textContent``), never HTML.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from swarm.errors import SwarmError
from swarm.node.generation.ringview import build_view
from swarm.node.members.failure import DEFAULT_SUSPECT_AFTER

STATIC = Path(__file__).parent / "static"
ASSETS = {"console.html", "chat.html", "console.css", "console.js", "ring.js", "chat.js", "sse.js"}
FEED_INTERVAL_S = 1.0
STATUS_TIMEOUT_S = 5.0  # a status that takes longer is reported as missing for this tick
MAX_WATCHERS = 8  # feeds open at once; the next is answered 429
EVENTS_KEPT = 200
SUSPECT_AFTER_S = DEFAULT_SUSPECT_AFTER  # a heartbeat older than this: the detector suspects the peer


def _hop_paths(view: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(h.get("from", ""), h.get("to", "")): str(h.get("path", "?")) for h in view.get("hops") or []}


def traversal_split(st: dict[str, Any], view: dict[str, Any]) -> dict[str, Any]:
    """Where a traversal's time goes: the plan's one-way hop estimates and each stage's compute
    (layers x its ms per layer), beside the median measured on the last generation."""
    plan = st.get("plan") or {}
    ring = [r for r in view["ring"] if r["role"] != "coordinator"]
    coord = view.get("coordinator")
    path = [coord, *[r["peer"] for r in ring], coord]
    hops_ms = list(plan.get("hops_ms") or [])
    parts: list[dict[str, Any]] = []
    for i, r in enumerate(ring):
        if i < len(hops_ms):
            parts.append({"kind": "hop", "from": path[i], "to": path[i + 1], "ms": hops_ms[i]})
        ms = None if r["ms_per_layer"] is None else r["layers"] * r["ms_per_layer"]
        parts.append({"kind": "compute", "peer": r["peer"], "ms": ms})
    if len(ring) < len(hops_ms):
        parts.append({"kind": "hop", "from": path[-2], "to": path[-1], "ms": hops_ms[len(ring)]})
    runs = st.get("runs") or []
    measured = runs[-1].get("traversal_ms") if runs else None
    return {"parts": parts, "predicted_ms": plan.get("predicted_traversal_ms"), "measured_ms": measured,
            "how": "predicted from the plan: one-way hops from measured RTTs, compute from each stage's ms per layer"}  # fmt: skip


def console_state(st: dict[str, Any]) -> dict[str, Any]:
    """A coordinator's status -> what the console draws (pure; JSON-ready)."""
    view = build_view(st)
    paths = _hop_paths(view)
    for r in view["ring"]:
        r["hop_path"] = paths.get((r["peer"], r["next"] or ""), r["path"]) if r["next"] else None
    plan = st.get("plan") or {}
    runs = [r for r in st.get("runs") or [] if isinstance(r, dict)]
    cap = st.get("capacity") or {}
    traversals = [r["traversal_ms"] for r in runs if r.get("traversal_ms") is not None]
    return {
        "type": "state", "t": time.time(), "view": view, "n_layers": plan.get("n_layers"), "cause": plan.get("cause", ""),
        "split": traversal_split(st, view) if view["ring"] else None, "runs": runs,
        "traversal_ms": statistics.median(traversals[-5:]) if traversals else None,
        "sessions": {"active": cap.get("active"), "capacity": cap.get("sessions"), "queued": cap.get("queued")},
        "members": len({*(st.get("members") or []), st.get("peer_id")} - {None}),
    }  # fmt: skip


class Timeline:
    """Status after status in, events out: what changed between two (pure; time is an input).

    An event is a dict with an ``id``; a re-plan is sent again, with the same id, when the status
    later learns its pause (the new plan's arrival), so the page replaces it in place."""

    def __init__(self, keep: int = EVENTS_KEPT) -> None:
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self.seq = 0
        self._members: set[str] | None = None
        self._suspects: set[str] = set()
        self._replans: dict[str, dict[str, Any]] = {}
        self._epoch: int | None = None

    def _add(self, now: float, kind: str, text: str, key: str | None = None, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        ev = {"type": "event", "seq": self.seq, "id": key or f"e{self.seq}", "t": now, "kind": kind, "text": text,
              **fields}  # fmt: skip
        self.events.append(ev)
        return ev

    def observe(self, st: dict[str, Any], now: float) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        members = {*(st.get("members") or []), st.get("peer_id") or ""} - {""}
        if self._members is not None:
            out += [self._add(now, "join", "joined", peer=p) for p in sorted(members - self._members)]
            out += [self._add(now, "leave", "left (or lost)", peer=p) for p in sorted(self._members - members)]
        self._members = members
        info = st.get("peer_info") or {}
        for peer, pi in sorted(info.items()):
            age = pi.get("heartbeat_age_s") if isinstance(pi, dict) else None
            if age is not None and age > SUSPECT_AFTER_S and peer not in self._suspects and peer in members:
                self._suspects.add(peer)
                out.append(self._add(now, "suspect", f"silent for {age:.1f} s", peer=peer))
            elif (age is None or age <= SUSPECT_AFTER_S) and peer in self._suspects:
                self._suspects.discard(peer)
        for rp in st.get("replans") or []:
            if not isinstance(rp, dict):
                continue
            key = f"replan-{rp.get('epoch')}"
            seen = self._replans.get(key)
            if seen is not None and seen.get("pause_s") == rp.get("pause_s"):
                continue
            fields: dict[str, Any] = {"epoch": rp.get("epoch"), "reason": str(rp.get("reason", "")), "cause": str(rp.get("cause", "")),
                      "pause_s": rp.get("pause_s"), "next_epoch": rp.get("next_epoch"),
                      "ended_unix": rp.get("ended")}  # fmt: skip
            if seen is None:
                ev = self._add(now, "replan", f"epoch {rp.get('epoch')} ended", key, **fields)
            else:
                seen.update(fields)
                self.seq += 1
                seen["seq"] = self.seq
                ev = seen
            self._replans[key] = ev
            out.append(ev)
        plan = st.get("plan") or {}
        epoch = st.get("epoch")
        if st.get("serving"):  # a re-plan is over once its next ring serves: how long that took, as seen here
            for ev in self._replans.values():
                if ev.get("next_epoch") == epoch and ev.get("serving_after_s") is None and ev.get("ended_unix"):
                    self.seq += 1
                    ev.update(seq=self.seq, serving_after_s=round(max(0.0, now - float(ev["ended_unix"])), 1))
                    out.append(ev)
        if epoch is not None and epoch != self._epoch:
            self._epoch = epoch
            out.append(self._add(now, "ring", f"epoch {epoch}: a ring of {len(plan.get('ring') or [])} stages",
                                 coordinator=plan.get("coordinator"), ring=list(plan.get("ring") or []),
                                 cause=str(plan.get("cause", ""))))  # fmt: skip
        return list({e["id"]: e for e in out}.values())  # a re-plan updated twice in one look is sent once


class Console:
    """The feed's shared state: the last status, the timeline, the pages watching."""

    def __init__(self, status: Callable[[], Awaitable[dict[str, Any]]], *, interval_s: float = FEED_INTERVAL_S) -> None:
        self.status = status
        self.interval_s = interval_s
        self.timeline = Timeline()
        self.state: dict[str, Any] | None = None
        self.error: str | None = None
        self.polled_at = -1e9
        self.watchers = 0
        self._lock = trio.Lock()

    async def refresh(self) -> None:
        """Ask for the status unless another page's feed did within the interval."""
        async with self._lock:
            if trio.current_time() - self.polled_at < 0.8 * self.interval_s:
                return
            self.polled_at = trio.current_time()
            st: dict[str, Any] | None = None
            with trio.move_on_after(STATUS_TIMEOUT_S):
                try:
                    st = await self.status()
                    self.error = None
                except SwarmError as exc:
                    self.error = f"the swarm did not answer: {str(exc)[:300]}"
            if st is None:
                self.error = self.error or f"no status within {STATUS_TIMEOUT_S:.0f} s (the swarm may be re-planning)"
                return
            self.state = console_state(st)
            self.timeline.observe(st, time.time())

    def snapshot(self) -> dict[str, Any]:
        base = self.state or {"type": "state", "view": None}
        return {**base, "error": self.error, "stale": self.error is not None}

    async def feed(self, emit: Callable[[Any], Awaitable[None]]) -> None:
        sent = 0
        while True:
            await self.refresh()
            await emit(self.snapshot())
            for ev in [e for e in self.timeline.events if e["seq"] > sent]:
                await emit(ev)
            sent = self.timeline.seq
            await trio.sleep(self.interval_s)


def run_summary(receipt: dict[str, Any] | None) -> dict[str, Any]:
    """What the chat page shows under an answer, from the swarm's receipt (``swarm`` in the last
    streamed chunk, beside ``usage``)."""
    r = receipt or {}
    keys = ("tokens_per_s", "decode_tokens_per_s", "accepted_per_traversal", "traversal_ms", "output_sha256", "epoch")
    out = {k: r.get(k) for k in keys}
    draft = r.get("draft")
    out["draft"] = draft.get("ran") if isinstance(draft, dict) else None
    return out


def console_routes(backend: Any) -> list[Route]:
    """The console's routes for ``backend`` (server.py adds them to the endpoint's app)."""
    from swarm.api.server import _SSE  # the endpoint's event stream, with its disconnect watch

    console = Console(lambda: backend.status())  # looked up when a page watches

    async def page(request: Request) -> Response:
        name = "chat.html" if request.url.path == "/chat" else "console.html"
        return FileResponse(STATIC / name, headers=_NO_STORE)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return JSONResponse({"error": f"no console asset {name[:80]!r}"}, status_code=404)
        return FileResponse(STATIC / name, headers=_NO_STORE)

    async def state(request: Request) -> Response:
        await console.refresh()
        return JSONResponse({**console.snapshot(), "events": list(console.timeline.events),
                             "model": backend.model_name})  # fmt: skip

    async def feed(request: Request) -> Response:
        if console.watchers >= MAX_WATCHERS:
            return JSONResponse({"error": f"{MAX_WATCHERS} console feeds are open on this node (its limit)"},
                                status_code=429, headers={"Retry-After": "5"})  # fmt: skip

        async def produce(emit: Callable[[Any], Awaitable[None]]) -> None:
            console.watchers += 1
            try:
                await emit({"type": "hello", "model": backend.model_name})
                await console.feed(emit)
            finally:
                console.watchers -= 1

        return _SSE(produce)

    return [
        Route("/", page, methods=["GET"]),
        Route("/chat", page, methods=["GET"]),
        Route("/static/console/{name}", asset, methods=["GET"]),
        Route("/console/feed", feed, methods=["GET"]),
        Route("/console/feed/state", state, methods=["GET"]),
    ]


# a page's scripts never run from a stale cache after an upgrade; a strict policy keeps any
# markup that slipped through from loading or running anything (the page itself renders text)
_NO_STORE = {"Cache-Control": "no-store",
             "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"}  # fmt: skip
