"""``shard-swarm status``: the view built from a status dict, its text rendering, and the command
against a real node (in a thread, with its own trio.run) reached through a signed invite."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import typer
from typer.testing import CliRunner

from swarm.cli import status as status_cmd
from swarm.cli.status import build_view, format_text
from swarm.launch import free_ports
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.manifest.schema import SwarmSecret
from swarm.node.peer import run_peer
from swarm.node.settings import NodeSettings
from swarm.testing.checkpoints import TinySpec, write_checkpoint

A, B, C, D = ("12D3KooWAaaaaaaaaaaaaaaaaaaa", "12D3KooWBbbbbbbbbbbbbbbbbbbb", "12D3KooWCccccccccccccccccccc",
              "12D3KooWDddddddddddddddddddd")  # fmt: skip
STATUS: dict[str, Any] = {
    "peer_id": B, "leader": A, "epoch": 3, "serving": True, "members": [A, B, C, D],
    "plan": {"coordinator": A, "ring": [C, B], "blocks": {C: [0, 10], B: [10, 30]}, "standbys": [D]},
    "peers_file": {"peers": [{"id": A, "memory_gb": 1.5, "ms_per_layer": 0.5}, {"id": B, "memory_gb": 8.0, "ms_per_layer": 0.61},
                             {"id": C, "memory_gb": 4.0, "ms_per_layer": 0.7}],
                   "rtt_ms": {A: {C: 10.0}, C: {B: 20.0}, B: {A: 30.5}}},
    "peer_info": {C: {"device": "cuda:0", "memory_used_bytes": 1.25e9, "heartbeat_age_s": 0.4, "path": "hole-punched"}},
    "recent": {"tokens_per_s": 12.5, "accepted_per_traversal": 2.25},
    "replans": [{"epoch": 2, "reason": "ring member lost"}],
}  # fmt: skip


def test_view_follows_the_ring() -> None:
    v = build_view(STATUS)
    assert [(r["peer"], r["role"], r["block"], r["next"]) for r in v["ring"]] == [
        (A, "coordinator", None, C), (C, "stage", [0, 10], B), (B, "stage", [10, 30], A)]  # fmt: skip
    assert [r["rtt_next_ms"] for r in v["ring"]] == [10.0, 20.0, 30.5] and v["ring_rtt_ms"] == 60.5
    c = v["ring"][1]
    assert (c["device"], c["memory_used_gb"], c["memory_offered_gb"], c["path"]) == ("cuda:0", 1.25, 4.0, "hole-punched")
    assert v["ring"][2]["device"] is None and v["ring"][2]["heartbeat_age_s"] is None  # not reported: not guessed
    assert [(r["peer"], r["role"]) for r in v["others"]] == [(D, "standby")]
    assert (v["tokens_per_s"], v["accepted_per_traversal"], v["replans"], v["epoch"]) == (12.5, 2.25, 1, 3)
    json.dumps(v)  # JSON-ready


def test_the_asked_nodes_predicted_peak_is_shown_beside_the_measured_one() -> None:
    st = {**STATUS, "memory": {"offered_bytes": 2_000_000_000, "predicted_peak_bytes": 1_500_000_000,
                               "measured_peak_bytes": 1_400_000_000, "measured_rss_bytes": 1_100_000_000}}
    v = build_view(st)
    assert v["memory"] == {"offered_gb": 2.0, "predicted_peak_gb": 1.5, "measured_peak_gb": 1.4, "measured_rss_gb": 1.1}
    line = next(x for x in format_text(v).splitlines() if x.startswith("memory of"))
    assert "predicted peak 1.50 GB · measured peak 1.40 GB (now 1.10 GB) · offered 2.00 GB" in line
    assert not any(x.startswith("memory of") for x in format_text(build_view(STATUS)).splitlines())  # none reported


def test_unknown_rtt_and_no_plan() -> None:
    st = {**STATUS, "peers_file": {**STATUS["peers_file"], "rtt_ms": {A: {C: 10.0}}}}
    v = build_view(st)
    assert v["ring"][1]["rtt_next_ms"] is None and v["ring_rtt_ms"] is None
    empty = build_view({"peer_id": A, "members": [A, B], "serving": False, "plan": None})
    assert empty["ring"] == [] and [r["role"] for r in empty["others"]] == ["member", "member"]
    assert "not serving" in format_text(empty)


def test_text_rendering() -> None:
    text = format_text(build_view(STATUS))
    lines = text.splitlines()
    assert lines[0].startswith("swarm epoch 3 · serving · coordinator 12D3KooWAaaaaa…")
    assert "60.5 ms of hops per traversal" in lines[1] and "12.5 tok/s" in lines[1] and "2.25 tokens" in lines[1]
    header, rows = lines[2], lines[3:]
    assert header.split()[:3] == ["#", "peer", "role"]
    assert rows[0].split()[:3] == ["0", "12D3KooWAaaaaa…", "coordinator"]
    assert "[0, 10)" in rows[1] and "cuda:0" in rows[1] and "1.25/4.00 GB" in rows[1] and "hole-punched" in rows[1]
    assert "20.0 ms" in rows[1] and "0.4 s" in rows[1]
    assert "[10, 30)" in rows[2] and "-/8.00 GB" in rows[2]
    assert "standby" in rows[3]
    assert "\x1b[" not in text  # plain: no colour codes


class NodeThread:
    """A real one-node swarm in a thread (its own trio.run), reachable on loopback."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings, self.ready, self.error = settings, threading.Event(), None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # surfaced by the test
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self.scope = nursery.cancel_scope
            node = await nursery.start(run_peer, self.settings)
            with trio.fail_after(30):
                while node.epoch is None or not node.epoch.serving.is_set():
                    await trio.sleep(0.05)
            self.ready.set()

    def __enter__(self) -> NodeThread:
        self.thread.start()
        assert self.ready.wait(60) and self.error is None, self.error
        return self

    def __exit__(self, *exc: object) -> None:
        trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
        self.thread.join(10)


@pytest.fixture
def one_node(tmp_path: Path) -> Iterator[tuple[Path, str, str]]:
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(n_layers=4), seed=1)
    ident = Identity(os.urandom(32))
    port = free_ports(1)[0]
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ident.peer_id}"
    m = sign_manifest(new_manifest(swarm_name="status-test", issuer=ident.public_key, bootstrap=(addr,),
                                   secret=SwarmSecret(os.urandom(32))), ident)  # fmt: skip
    path = tmp_path / "invite.json"
    write_manifest(m, path)
    settings = NodeSettings(seed=ident.seed, swarm_id=m.swarm_id, secret=m.secret.value, model_dir=ckpt,
                            listen=(f"/ip4/127.0.0.1/tcp/{port}",), dtype=torch.float32, expect_peers=1)  # fmt: skip
    with NodeThread(settings):
        yield path, addr, ident.peer_id


def test_status_command_against_a_node(one_node: tuple[Path, str, str]) -> None:
    path, addr, peer = one_node
    app = typer.Typer()
    app.callback()(lambda: None)
    status_cmd.register(app)
    r = CliRunner().invoke(app, ["status", "--manifest", str(path), "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    view = json.loads(r.stdout)
    assert view["serving"] and view["coordinator"] == peer and view["asked"] == peer
    assert [(x["peer"], x["role"], x["block"]) for x in view["ring"]] == [(peer, "coordinator+stage", [0, 4])]
    assert view["ring"][0]["ms_per_layer"] > 0 and view["ring"][0]["memory_offered_gb"] > 0
    mem = view["memory"]  # the whole predicted peak (runtime included) beside what /proc measured
    assert mem["predicted_peak_gb"] > 0.42 and mem["measured_peak_gb"] >= mem["measured_rss_gb"] > 0, mem
    text = CliRunner().invoke(app, ["status", "--manifest", str(path), "--peer", addr])  # not a TTY: plain text
    assert text.exit_code == 0 and "coordinator+stage" in text.stdout and "[0, 4)" in text.stdout
    bad = CliRunner().invoke(app, ["status", "--manifest", str(path), "--peer", "/ip4/127.0.0.1/tcp/1"])
    assert bad.exit_code != 0 and "/p2p/" in str(bad.exception)


def test_status_web_prints_the_consoles_url_from_the_flag_or_the_config(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from swarm.errors import UsageError

    app = typer.Typer()
    app.callback()(lambda: None)
    status_cmd.register(app)
    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path))
    none = CliRunner().invoke(app, ["status", "--web"])
    assert isinstance(none.exception, UsageError) and "join --api" in str(none.exception)
    port = free_ports(1)[0]  # nothing listens there
    r = CliRunner().invoke(app, ["status", "--web", "--api", f"0.0.0.0:{port}"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout == f"http://127.0.0.1:{port}/\n" and "nothing answers" in r.stderr
    (tmp_path / "config.toml").write_text(f'[api]\naddress = "[::1]:{port}"\n')
    r = CliRunner().invoke(app, ["status", "--web"])
    assert r.exit_code == 0 and r.stdout == f"http://[::1]:{port}/\n"
