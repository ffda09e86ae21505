"""What a person meets after an ordinary mistake: one line with a hint, the documented exit
code (README, "Exit codes"), and no traceback unless ``--verbose``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from tests.cli.joinkit import ROOT, free_port

pytestmark = pytest.mark.slow


def _cli(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHARD_SWARM_CONFIG": str(tmp / "cfg"), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "swarm.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)  # fmt: skip


def _one_line(out: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, (out.returncode, out.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and " -- hint: " in lines[0], out.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_a_dead_swarm_a_wrong_invite_and_verbose(tmp_path: Path) -> None:
    ident = Identity(bytes([7]) * 32)
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{ident.peer_id}"  # nothing listens there
    invite = tmp_path / "invite.json"
    write_manifest(sign_manifest(new_manifest(swarm_name="lab", issuer=ident.public_key, bootstrap=(dead,)), ident), invite)

    _one_line(_cli("status", "--manifest", str(invite), "--timeout", "2", tmp=tmp_path), 7, "nothing listens at", dead)
    _one_line(_cli("generate", "--manifest", str(invite), "--prompt", "hi", "--timeout", "2", tmp=tmp_path), 7,
              "nothing listens at")  # fmt: skip

    bad = tmp_path / "tampered.json"
    data = json.loads(invite.read_text())
    data["swarm_name"] = "lab!"
    bad.write_text(json.dumps(data))
    bad.chmod(0o600)
    _one_line(_cli("status", "--manifest", str(bad), tmp=tmp_path), 4, str(bad))

    # --verbose: the same exit code, and now the details
    out = _cli("--verbose", "status", "--manifest", str(invite), "--timeout", "2", tmp=tmp_path)
    assert out.returncode == 7 and "Traceback" in out.stderr, out.stderr[-2000:]
