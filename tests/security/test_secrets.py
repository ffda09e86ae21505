"""Secrets never leak: not in node logs, receipts, status, errors, reprs or process arguments.

Runs after the attacks in this package (it sorts last in the file order pytest uses), so the logs
searched hold admissions, refusals, forged adverts and broken frames as well as generations.
Looked for: the swarm secret as hex (both cases), base64 (standard and URL-safe, with and without
padding), any 8-byte window of it as hex, and the raw bytes; and the nodes' identity seeds as hex.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from swarm import client
from swarm.errors import AdmissionError
from swarm.manifest.identity import Identity, IdentityError, load_identity
from swarm.manifest.manifest import new_manifest, sign_manifest, write_manifest
from swarm.proto.admission import client_secret

from .swarmkit import LiveSwarm, assert_still_serving, honest_client, outsider

pytestmark = pytest.mark.slow


def secret_forms(secret: bytes) -> list[str]:
    hx = secret.hex()
    forms = {
        hx,
        hx.upper(),
        base64.b64encode(secret).decode(),
        base64.urlsafe_b64encode(secret).decode(),
    }
    forms |= {f.rstrip("=") for f in list(forms)}
    forms |= {hx[i : i + 16] for i in range(0, len(hx) - 15, 2)}  # any 8 bytes of it
    return sorted(forms)


def leaks(text: str, secret: bytes) -> list[str]:
    return [f for f in secret_forms(secret) if f in text]


def test_secret_forms_are_found_when_present() -> None:
    """The detector itself: each form of a secret embedded in text is caught."""
    s = os.urandom(32)
    for form in (s.hex(), base64.b64encode(s).decode().rstrip("="), base64.urlsafe_b64encode(s).decode(),
                 s.hex()[10:30]):  # fmt: skip
        assert leaks(f"log line {form} end", s), form
    assert not leaks("nothing here " + os.urandom(32).hex(), s)


async def test_no_secret_in_logs_receipts_status_or_errors(live: LiveSwarm) -> None:
    sw = live.swarm
    await assert_still_serving(live)
    for i in range(len(sw.procs)):  # status as every node reports it
        async with honest_client(live, i) as (h, peer):
            live.statuses.append(await client.status(h, peer))
    outsider_secret = os.urandom(32)
    async with outsider(secret=outsider_secret, swarm_id=sw.swarm_id) as h:  # an error about the secret, from both sides
        with pytest.raises(AdmissionError) as err:
            await h.dial(sw.addrs[0])
    texts = {
        "error": str(err.value) + repr(err.value),
        "receipts": json.dumps(live.receipts),
        "status": json.dumps(live.statuses),
    }
    for i in range(len(sw.procs)):
        texts[f"node{i}.log"] = sw.log(i)
        texts[f"node{i}.json"] = (sw.workdir / f"node{i}.json").read_text()
        pid = sw.procs[i].pid
        texts[f"node{i} argv"] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        texts[f"node{i} environ"] = (
            Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        )
    assert live.receipts and len(live.statuses) >= 3
    seeds = [
        bytes.fromhex((sw.workdir / f"node{i}.seed").read_text()) for i in range(len(sw.procs))
    ]
    for name, text in texts.items():
        assert not leaks(text, sw.secret), f"the swarm secret appears in {name}"
        assert not leaks(text, outsider_secret), f"the outsider's secret appears in {name}"
        assert not leaks(text, client_secret(sw.secret)), f"the client secret appears in {name}"
        for seed in seeds:
            assert not leaks(text, seed), f"an identity seed appears in {name}"
    raw = b"".join((sw.workdir / f"node{i}.log").read_bytes() for i in range(len(sw.procs)))
    assert sw.secret not in raw
    # every file of the swarm's directory that holds the secret or a seed is private (0600)
    holders = []
    for f in sorted(sw.workdir.iterdir()):
        if not f.is_file():
            continue
        text = f.read_bytes().decode(errors="replace")
        if any(leaks(text, s) for s in (sw.secret, *seeds)):
            holders.append(f.name)
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, (
                f"{f.name} holds a secret with mode {f.stat().st_mode:o}"
            )
    assert len(holders) >= 1 + len(seeds), holders  # the invite (or secret file) and every seed


def test_invite_and_key_files_are_private_and_reprs_hide_the_secret(tmp_path: Path) -> None:
    ident = Identity(os.urandom(32))
    m = sign_manifest(new_manifest(swarm_name="sec", issuer=ident.public_key), ident)
    secret = m.secret.value
    for text in (repr(m), str(m), repr(m.secret), str(m.secret)):
        assert not leaks(text, secret), text
    path = tmp_path / "invite.json"
    write_manifest(m, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = tmp_path / "identity.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_identity(key)


def test_the_api_token_never_comes_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """argv is readable by every user in /proc/*/cmdline: `join --api-token` is refused with the
    ways that are not (a file, the environment, the config file)."""
    import subprocess
    import sys

    from swarm.cli.join import _api_token
    from swarm.errors import UsageError

    monkeypatch.setenv("SHARD_SWARM_CONFIG", str(tmp_path / "cfg"))
    monkeypatch.delenv("SHARD_SWARM_API_TOKEN", raising=False)
    with pytest.raises(UsageError, match=r"/proc/\*/cmdline.*--api-token-file"):
        _api_token(None, "t0ken")
    f = tmp_path / "token"
    f.write_text("from-a-file\n")
    assert _api_token(f, None) == "from-a-file"
    monkeypatch.setenv("SHARD_SWARM_API_TOKEN", "from-the-env")
    assert _api_token(None, None) == "from-the-env"
    out = subprocess.run([sys.executable, "-m", "swarm.cli.main", "join", "--api-token", "t0ken", "--api", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "SHARD_SWARM_CONFIG": str(tmp_path / "cfg")})  # fmt: skip
    assert out.returncode == 2 and "/proc/*/cmdline" in out.stderr, out.stderr[-2000:]
