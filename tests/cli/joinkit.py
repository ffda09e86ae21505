"""``shard-swarm join`` processes for the user's-path tests: a tiny checkpoint pinned by an
invite, one config dir and key per node, stdout parsed as JSON events, stderr kept."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.launch import offer_for
from swarm.manifest.identity import Identity, save_identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.manifest.modelcheck import describe_model
from swarm.testing.checkpoints import TinySpec, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
N_LAYERS = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JoinProc:
    """One ``python -m swarm.cli.join --json`` process."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli.join", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        threading.Thread(target=self._pump, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, False), daemon=True).start()

    def _pump(self, stream: Any, is_out: bool) -> None:
        for line in stream:
            if is_out:
                self.events.append(json.loads(line))  # every stdout line is one JSON object
            else:
                self.stderr.append(line)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e["event"] == kind]

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def tail(self) -> str:
        return f"--- {self.name}: events {[e for e in self.events if e['event'] != 'rtt'][-8:]}\n{''.join(self.stderr[-15:])}"


class Lab:
    """A swarm of join processes on loopback; node 0 is the invite's bootstrap."""

    def __init__(self, tmp: Path, n: int) -> None:
        self.tmp = tmp
        self.ckpt = write_checkpoint(tmp / "tiny", TinySpec(n_layers=N_LAYERS), seed=5)
        # sorted by peer ID: node 0 (the invite's bootstrap) is the one every node calls its leader
        self.ids = sorted((Identity(bytes([i + 21]) * 32) for i in range(n)), key=lambda ident: ident.peer_id)
        self.port = free_port()
        boot = f"/ip4/127.0.0.1/tcp/{self.port}/p2p/{self.ids[0].peer_id}"
        self.invite = tmp / "invite.json"
        manifest = new_manifest(swarm_name="lab", issuer=self.ids[0].public_key, bootstrap=(boot,),
                                model=describe_model(self.ckpt), context=2048)  # fmt: skip
        write_manifest(sign_manifest(manifest, self.ids[0]), self.invite)
        self.procs: list[JoinProc] = []

    def memory(self, layers: int) -> int:
        """An fp32 CPU node's --memory for ``layers`` layers and the head (launch.offer_for)."""
        return offer_for(self.ckpt, layers, context_tokens=2048)

    def start(self, i: int, layers: int) -> JoinProc:
        key = self.tmp / f"node{i}.key"
        save_identity(self.ids[i], key)
        env = {**os.environ, "SHARD_SWARM_CONFIG": str(self.tmp / f"cfg{i}"), "PYTHONPATH": str(ROOT)}
        listen = f"/ip4/127.0.0.1/tcp/{self.port if i == 0 else 0}"
        args = ["--manifest", str(self.invite), "--key", str(key), "--listen", listen, "--model", str(self.ckpt),
                "--dtype", "fp32", "--threads", "1", "--memory", str(self.memory(layers)), "--no-mdns", "--no-relay",
                "--json"]  # fmt: skip
        p = JoinProc(f"n{i}", args, env)
        self.procs.append(p)
        return p

    def wait(self, pred: Callable[[], bool], timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n" + "\n".join(p.tail() for p in self.procs))
            time.sleep(0.05)
        return time.monotonic() - t0

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(timeout=10)
