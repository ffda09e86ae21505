"""The web console's feed without a browser: the pure state and timeline, then the routes on a
real node (NodeBackend) over plain HTTP: the token, the event stream, the assets, the chat's
receipt summary beside ``usage``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trio

from swarm.api.backend import NodeBackend
from swarm.api.console import ASSETS, STATIC, SUSPECT_AFTER_S, Timeline, console_state
from swarm.api.server import serve_api
from swarm.node.peer import run_peer
from swarm.node.settings import NodeSettings

A, B, C = "12D3KooWA", "12D3KooWB", "12D3KooWC"
TOKEN = "console-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def status(members: list[str], *, epoch: int = 1, replans: list[dict[str, Any]] | None = None,
           ages: dict[str, float] | None = None) -> dict[str, Any]:  # fmt: skip
    """A coordinator's status (report.py's shape) for a ring A (coordinator, layers 0-2) -> B (2-4)."""
    return {
        "peer_id": A, "members": [m for m in members if m != A], "leader": A, "epoch": epoch, "serving": True,
        "plan": {"coordinator": A, "ring": [A, B], "blocks": {A: [0, 2], B: [2, 4]}, "standbys": [], "cause": "first plan",
                 "n_layers": 4, "hops_ms": [0.0, 1.5, 2.5], "predicted_compute_ms": 4.0, "predicted_traversal_ms": 8.0},
        "peers_file": {"peers": [{"id": A, "memory_gb": 1.0, "ms_per_layer": 1.0}, {"id": B, "memory_gb": 2.0, "ms_per_layer": 1.0}],
                       "rtt_ms": {A: {B: 3.0}, B: {A: 5.0}}},
        "peer_info": {p: {"device": "cpu:x", "memory_used_bytes": 10, "path": "direct",
                          "heartbeat_age_s": (ages or {}).get(p, 0.1)} for p in members},
        "hops": [{"from": A, "to": A, "path": "local"}, {"from": A, "to": B, "path": "relayed via 12D3KooWR"},
                 {"from": B, "to": A, "path": "hole-punched"}],
        "runs": [{"ended_unix": 1.0, "epoch": 1, "tokens": 8, "tokens_per_s": 20.0, "accepted_per_traversal": 2.0,
                  "traversal_ms": 9.0}],
        "replans": replans or [], "capacity": {"sessions": 8, "active": 1, "queued": 2},
        "recent": {"tokens_per_s": 20.0, "accepted_per_traversal": 2.0},
    }  # fmt: skip


def test_state_is_the_ring_with_each_hops_path_and_where_a_traversal_goes() -> None:
    st = console_state(status([A, B, C]))
    rows = st["view"]["ring"]
    assert [(r["peer"], r["block"], r["next"], r["hop_path"]) for r in rows] == [
        (A, [0, 2], B, "relayed via 12D3KooWR"), (B, [2, 4], A, "hole-punched")]  # fmt: skip
    assert [r["peer"] for r in st["view"]["others"]] == [C]
    parts = st["split"]["parts"]
    assert [(p["kind"], p["ms"]) for p in parts] == [("hop", 0.0), ("compute", 2.0), ("hop", 1.5), ("compute", 2.0),
                                                     ("hop", 2.5)]  # fmt: skip
    assert st["split"]["measured_ms"] == 9.0 and st["split"]["predicted_ms"] == 8.0
    assert st["sessions"] == {"active": 1, "capacity": 8, "queued": 2} and st["members"] == 3
    assert st["n_layers"] == 4 and st["cause"] == "first plan"
    json.dumps(st)  # JSON-ready


def test_timeline_turns_status_changes_into_events() -> None:
    tl = Timeline()
    first = tl.observe(status([A, B, C]), now=0.0)
    assert [e["kind"] for e in first] == ["ring"]  # nothing joined: the first view is the baseline
    ev = tl.observe(status([A, B, C], ages={C: SUSPECT_AFTER_S + 1}), now=1.0)
    assert [(e["kind"], e["peer"]) for e in ev] == [("suspect", C)]
    assert tl.observe(status([A, B, C], ages={C: SUSPECT_AFTER_S + 2}), now=2.0) == []  # said once
    ended = {"epoch": 1, "ended": 3.0, "reason": "peer 12D3KooWC lost"}
    ev = tl.observe(status([A, B], epoch=1, replans=[ended]), now=3.0)
    assert [e["kind"] for e in ev] == ["leave", "replan"]
    replan = ev[1]
    assert replan["pause_s"] is None and replan["reason"] == "peer 12D3KooWC lost"
    # the next plan arrives: the same event (same id) is sent again with its cause and pause
    later = {**ended, "next_epoch": 2, "cause": "peer 12D3KooWC is gone", "pause_s": 1.25}
    ev = tl.observe(status([A, B], epoch=2, replans=[later]), now=4.0)
    assert [e["kind"] for e in ev] == ["replan", "ring"]
    assert ev[0]["id"] == replan["id"] and ev[0]["pause_s"] == 1.25 and ev[0]["cause"] == "peer 12D3KooWC is gone"
    assert ev[0]["seq"] > replan["seq"] - 1 and len([e for e in tl.events if e["kind"] == "replan"]) == 1
    assert ev[0]["serving_after_s"] == 1.0  # the new ring serves: 4.0 - ended 3.0
    ev = tl.observe(status([A, B, C], epoch=2, replans=[later]), now=5.0)
    assert [(e["kind"], e["peer"]) for e in ev] == [("join", C)]


def test_every_asset_ships_and_no_page_writes_html_from_data() -> None:
    assert {p.name for p in STATIC.iterdir()} == ASSETS
    for name in ASSETS:
        text = (STATIC / name).read_text()
        assert "innerHTML" not in text and "outerHTML" not in text and "insertAdjacentHTML" not in text, name
        # no CDN: no quoted URL to another host (the SVG namespace is a name, not a fetch)
        assert re.findall(r"[\"'`(]\s*(?:https?:)?//(?!www\.w3\.org/2000/svg)", text) == [], name


@pytest.fixture
async def node_api(tiny_chat_dir: Path) -> AsyncIterator[str]:
    s = NodeSettings(seed=os.urandom(32), swarm_id="console-test", secret=os.urandom(32), model_dir=tiny_chat_dir,
                     dtype=torch.float32, expect_peers=1, context_tokens=512, device_name="<b>x</b>")  # fmt: skip
    async with trio.open_nursery() as nursery:
        node = await nursery.start(run_peer, s)
        with trio.fail_after(30):
            while node.epoch is None or not node.epoch.serving.is_set():
                await trio.sleep(0.05)
        yield await nursery.start(lambda task_status: serve_api(NodeBackend(node), "127.0.0.1:0", token=TOKEN,
                                                                task_status=task_status))  # fmt: skip
        nursery.cancel_scope.cancel()


async def test_feed_streams_state_and_events_behind_the_token(node_api: str) -> None:
    async with httpx.AsyncClient(base_url=node_api, timeout=30) as http:
        assert (await http.get("/console/feed")).status_code == 401
        assert (await http.get("/console/feed/state")).status_code == 401
        page = await http.get("/")
        assert page.status_code == 200 and "/static/console/console.js" in page.text
        assert (await http.get("/static/console/ring.js")).status_code == 200
        assert (await http.get("/static/console/..%2Fconsole.py")).status_code == 404
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "draft": "none"}  # fmt: skip
        r = await http.post("/v1/chat/completions", json=body, headers=AUTH)
        last = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")][-1]
        assert last["usage"]["completion_tokens"] == 6
        assert last["swarm"]["tokens_per_s"] > 0 and last["swarm"]["draft"] == "none"
        assert len(last["swarm"]["output_sha256"]) == 64
        bad = await http.post("/v1/chat/completions", json={**body, "draft": "<b>"}, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "draft"
        seen: list[dict[str, Any]] = []
        async with http.stream("GET", "/console/feed", headers=AUTH) as feed:
            assert feed.headers["content-type"].startswith("text/event-stream")
            async for line in feed.aiter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                if sum(m["type"] == "state" for m in seen) == 2:
                    break
    kinds = [m["type"] for m in seen]
    assert kinds[0] == "hello" and "event" in kinds
    state = next(m for m in seen if m["type"] == "state")
    row = state["view"]["ring"][0]
    assert row["device"] == "cpu:<b>x</b>" and row["block"] == [0, 4]  # the page escapes it, not the feed
    assert state["runs"][-1]["tokens"] == 6 and state["sessions"]["capacity"] >= 1
    assert TOKEN not in json.dumps(seen)
