"""``shard-swarm join`` as separate processes on loopback: admission, convergence, a frozen peer.

Two nodes share one invite; node 0 is the bootstrap. A third process holds a valid invite to
another swarm and dials the same bootstrap. The two must admit and see each other with measured
RTTs, the intruder must be refused, a node frozen with SIGSTOP must be reported lost within a few
seconds and rejoin (as a new incarnation) after SIGCONT, and Ctrl-C (SIGINT) must leave cleanly
with exit code 0. Every process is killed in ``finally``. (Gossip to a third member and kills are
covered in-process by tests/node/test_membership.py; this keeps interpreter start-ups to three.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from swarm.cli.join import parse_size
from swarm.errors import UsageError
from swarm.manifest.identity import Identity, save_identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
ROOT = Path(__file__).resolve().parents[2]


class Node:
    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli.join", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        threading.Thread(target=self._pump_out, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def saw(self, kind: str, peer: str) -> bool:
        return any(e["event"] == kind and e["peer"] == peer for e in list(self.events))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred, timeout: float, what: str, nodes: list[Node]) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            logs = "\n".join(f"--- {n.name} stdout {n.events[-6:]}\n{''.join(n.stderr[-15:])}" for n in nodes)
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")
        for n in nodes:
            assert n.proc.poll() is None or n.proc.returncode == 0, f"{n.name} died: {''.join(n.stderr[-20:])}"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_parse_size() -> None:
    # G/GB are decimal, as every message (and the planner) says GB; GiB is binary
    assert parse_size("24G") == 24 * 10**9 and parse_size("512MB") == 512 * 10**6 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("120M") == 120 * 10**6 and parse_size("1000000") == 10**6
    assert parse_size("auto") >= 0
    with pytest.raises(UsageError, match="--memory"):
        parse_size("lots")


def test_join_processes_admit_converge_survive_a_frozen_peer_and_leave_cleanly(tmp_path: Path) -> None:
    ids = [Identity(bytes([i + 11]) * 32) for i in range(4)]
    keys = []
    for i, ident in enumerate(ids):
        keys.append(tmp_path / f"node{i}.key")
        save_identity(ident, keys[-1])
    port = _free_port()
    boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ids[0].peer_id}"
    invite = tmp_path / "invite.json"
    write_manifest(sign_manifest(new_manifest(swarm_name="lab", issuer=ids[0].public_key, bootstrap=(boot,)), ids[0]), invite)
    other = tmp_path / "other.json"  # a valid invite to a different swarm (other secret)
    write_manifest(sign_manifest(new_manifest(swarm_name="evil", issuer=ids[3].public_key, bootstrap=(boot,)), ids[3]), other)
    env = {**os.environ, "SHARD_SWARM_CONFIG": str(tmp_path / "cfg"), "PYTHONPATH": str(ROOT)}
    common = ["--no-mdns", "--json", "--memory", "1G"]
    nodes: list[Node] = []
    try:
        nodes.append(Node("n0", ["--manifest", str(invite), "--key", str(keys[0]), "--listen", f"/ip4/127.0.0.1/tcp/{port}", *common], env))
        for i in (1,):
            nodes.append(Node(f"n{i}", ["--manifest", str(invite), "--key", str(keys[i]), "--listen", "/ip4/127.0.0.1/tcp/0", *common], env))
        # started at the same time (interpreter start-up dominates on a busy machine)
        nodes.append(Node("intruder", ["--manifest", str(other), "--key", str(keys[3]), "--listen", "/ip4/127.0.0.1/tcp/0", *common], env))
        pid = [i.peer_id for i in ids]
        _wait(lambda: all(n.saw("joined", pid[j]) for i, n in enumerate(nodes[:2]) for j in range(2) if j != i), 300, "convergence", nodes)  # start-ups: slow on a busy box
        _wait(lambda: all(any(e["event"] == "rtt" for e in n.events) for n in nodes[:2]), 15, "measured RTTs", nodes)
        assert all(e["rtt_ms"] is None or 0 < e["rtt_ms"] < 2000 for n in nodes for e in n.events if "rtt_ms" in e)
        joined = next(e for e in nodes[1].events if e["event"] == "joined" and e["peer"] == pid[0])
        assert joined["how"] == "dialed" and joined["addr"] == f"/ip4/127.0.0.1/tcp/{port}" and joined["path"] == "direct"

        # The intruder (another swarm's invite, same bootstrap) is refused; nobody lets it in.
        _wait(lambda: nodes[0].saw("refused", pid[3]), 30, "the intruder's refusal", nodes)
        assert not any(n.saw("joined", pid[3]) for n in nodes[:2])

        # Freeze node 1: node 0 must declare it lost within a few seconds.
        nodes[1].proc.send_signal(signal.SIGSTOP)
        took = _wait(lambda: nodes[0].saw("left", pid[1]), 10, "lost after SIGSTOP", nodes)
        assert took < 6.0  # ~2.5 s of silence (+ scheduling slack on a shared 2-core box)
        nodes[1].proc.send_signal(signal.SIGCONT)
        _wait(lambda: nodes[0].saw("rejoined", pid[1]), 30, "rejoin after SIGCONT", nodes)
        assert [e.get("incarnation") for e in nodes[0].events if e["event"] == "rejoined"] == [1]

        # Ctrl-C: each node leaves cleanly.
        for n in nodes:
            n.proc.send_signal(signal.SIGINT)
        for n in nodes:
            assert n.proc.wait(timeout=15) == 0, "".join(n.stderr[-20:])
        assert any("left swarm 'lab'" in line for line in nodes[0].stderr)
        assert not any("Traceback" in line for n in nodes for line in n.stderr)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)
                n.proc.kill()
                n.proc.wait(timeout=10)


def test_register_adds_the_join_command_and_bad_invites_exit_4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import typer
    from typer.testing import CliRunner

    from swarm.cli import join as join_cli

    app = typer.Typer()
    join_cli.register(app)

    @app.command("other")
    def _other() -> None:  # a second command, so "join" is addressed by name as in shard-swarm
        return None

    out = CliRunner().invoke(app, ["join", "--help"])
    assert out.exit_code == 0 and "--manifest" in out.output and "--diagnose" in out.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert join_cli.main(["--manifest", str(bad), "--no-mdns"]) == 4
    assert join_cli.main(["--manifest", str(tmp_path / "missing.json"), "--no-mdns"]) == 4
    assert join_cli.main(["--manifest", str(bad), "--memory", "lots"]) in (2, 4)
