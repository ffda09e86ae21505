"""The README's "With friends" session, run as typed: every ``name$`` line of the transcript is
one command of that person (own config directory and working directory, the invite "sent" by
copying it), with only the machine-specific parts replaced: ``./model`` by a tiny checkpoint,
Alice's LAN address and port by loopback and a free port, and ``12D3KooWAlice...`` by the issuer
ID that ``invite verify`` printed. Lines ending in ``&`` keep running; the others must exit 0."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.api.conftest import tiny_chat_checkpoint
from tests.cli.joinkit import ROOT, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def transcript() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    start = text.index("## With friends")
    # the session ends at the next heading (the fetch walk-through after it, with its origin URL,
    # is run by tests/cli/test_fetch_join.py against a real HTTP server instead)
    section = text[start : re.compile(r"^##", re.M).search(text, start + 1).start()]  # type: ignore[union-attr]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^    (\w+)\$ (.*)$", section, re.M)]


def test_the_readme_session_runs_as_typed(tmp_path: Path) -> None:
    lines = transcript()
    assert [who for who, _ in lines][:2] == ["alice", "alice"] and any(c.startswith("shard-swarm generate") for _, c in lines)
    model = tiny_chat_checkpoint(tmp_path / "model")  # with a tokenizer: Carol's prompt is text
    port = free_port()
    alice_id = ""
    background: list[subprocess.Popen[str]] = []
    try:
        for who, cmd in lines:
            home = tmp_path / who
            home.mkdir(exist_ok=True)
            if who != "alice":
                shutil.copy(tmp_path / "alice" / "invite.json", home / "invite.json")  # Alice sent it
                for sent in (tmp_path / "alice").glob("*.invite"):  # and the client invite she made
                    shutil.copy(sent, home / sent.name)
            cmd = cmd.replace("./model", str(model)).replace("/ip4/0.0.0.0/tcp/4001", f"/ip4/127.0.0.1/tcp/{port}")
            cmd = cmd.replace("/ip4/192.168.1.5/tcp/4001", f"/ip4/127.0.0.1/tcp/{port}").replace("12D3KooWAlice...", alice_id)
            bg = cmd.endswith("&")
            argv = shlex.split(cmd.rstrip("& "))
            assert argv[0] == "shard-swarm", cmd
            argv = [sys.executable, "-m", "swarm.cli.main", *argv[1:]]
            if argv[3] == "join":
                argv += ["--no-mdns", "--no-relay", "--dtype", "fp32", "--threads", "1"]
            if "generate" in argv:
                argv += ["--timeout", "240", "--max-new-tokens", "8"]
            env = {**os.environ, "SHARD_SWARM_CONFIG": str(home / "cfg"), "PYTHONPATH": str(ROOT)}
            if bg:
                background.append(subprocess.Popen(argv, cwd=home, env=env, text=True, stdout=subprocess.DEVNULL,
                                                   stderr=open(home / "join.log", "w")))  # noqa: SIM115
                time.sleep(1.0)
                continue
            out = subprocess.run(argv, cwd=home, env=env, text=True, capture_output=True, timeout=400)
            assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-3000:],
                                         [(p.read_text()[-2000:]) for p in tmp_path.glob("*/join.log")])
            if "invite verify" in cmd:
                alice_id = re.search(r"issuer (12D3KooW\w+)", out.stderr).group(1)  # type: ignore[union-attr]
            if "generate" in cmd:
                assert out.stdout.strip(), out  # the answer, as text
            if "status" in cmd:
                assert alice_id[:14] in out.stdout, out.stdout
    finally:
        for p in background:
            p.kill()
            p.wait(timeout=10)
