"""A client invite through real processes: it runs generations and reads status, nothing else.

A client invite carries a secret derived one way from the swarm secret (plus the member key), so
its holder is admitted as a *client*. Against the shared 3-node swarm a client-credential party:
generates (the output equals the reference) and reads status, through the `generate` and `status`
commands a user runs; is refused every ring op, the activation protocol and the ctl protocol
(adverts) at the door; cannot get its own advert into a node's view even when a member relays it;
and cannot be admitted as a member with what its invite holds. The swarm keeps serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from swarm import client
from swarm.errors import AdmissionError, PeerError
from swarm.manifest.identity import Identity
from swarm.manifest.manifest import new_manifest, read_manifest, sign_manifest, write_manifest
from swarm.manifest.schema import SwarmSecret
from swarm.node.errors_util import first_leaf
from swarm.proto import control as ctl
from swarm.proto.admission import CLIENT, client_secret, member_key
from swarm.proto.limits import PROTO_ACT, PROTO_CTL, PROTO_RING
from swarm.proto.messages import Advert
from swarm.proto.signed import sign_advert

from .swarmkit import (
    MAX_NEW,
    PROMPT,
    LiveSwarm,
    admitted_attacker,
    assert_still_serving,
    current_plan,
)

pytestmark = pytest.mark.slow


def _client_invite(ls: LiveSwarm, path: Path) -> Path:
    """The swarm's client invite, as `invite create --from invite.json --client` writes it."""
    member = read_manifest(ls.swarm.workdir / "invite.json")
    issuer = Identity(os.urandom(32))  # the test swarm's issuer is throwaway: sign with another
    m = new_manifest(
        swarm_name=member.swarm_name, issuer=issuer.public_key, bootstrap=member.bootstrap, lifetime_s=3600,
        swarm_id=member.swarm_id, secret=SwarmSecret(client_secret(member.secret.value)), role="client",
        member_key=member_key(member.secret.value),
    )  # fmt: skip
    write_manifest(sign_manifest(m, issuer), path)
    return path


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swarm.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def _advert(ident: Identity, swarm_id: str) -> Advert:
    unsigned = Advert(peer_id="", public_key=b"", swarm_id=swarm_id, seq=10**12, memory_bytes=10**12,
                      device_kind="cuda", device_name="client posing as a member", layer_us=1)  # fmt: skip
    return sign_advert(unsigned, ident)


async def test_a_client_generates_and_reads_status_and_nothing_else(live: LiveSwarm, tmp_path: Path) -> None:
    sw = live.swarm
    secret = sw.secret
    invite = _client_invite(live, tmp_path / "client.json")
    assert read_manifest(invite).role == "client" and secret not in invite.read_bytes()

    # the user's path: generate and status with the client invite
    gen = await trio.to_thread.run_sync(lambda: _cli(
        "generate", "--manifest", str(invite), "--prompt-ids", ",".join(map(str, PROMPT)),
        "--max-new-tokens", str(MAX_NEW), "--draft", "none", "--json", "--timeout", "90"))  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert json.loads(gen.stdout)["output_token_ids"] == live.reference
    st = await trio.to_thread.run_sync(lambda: _cli("status", "--manifest", str(invite), "--json", "--timeout", "30"))
    assert st.returncode == 0, st.stderr[-3000:]
    view = json.loads(st.stdout)
    assert view["serving"] and view["coordinator"] in sw.peer_ids

    before = await current_plan(live)
    fake = Identity(os.urandom(32))
    for i, target in enumerate(sw.peer_ids):
        async with client.open_client(sw.addrs[i], secret=client_secret(secret), swarm_id=sw.swarm_id, role=CLIENT,
                                      member_key=member_key(secret)) as (h, peer):  # fmt: skip
            assert peer == target and h.admitted_role(peer) == "member"
            status = await client.status(h, peer)
            assert status["epoch"] == before["epoch"]
            for proto, msg in ((PROTO_RING, ctl.Fault(before["coordinator"], before["epoch"], "framed")),
                               (PROTO_RING, ctl.Ended((1 << 62) - 1)),
                               (PROTO_RING, ctl.Current()),
                               (PROTO_ACT, ctl.Hop(before["epoch"], 0)),
                               (PROTO_CTL, _advert(fake, sw.swarm_id))):  # fmt: skip
                with pytest.raises(PeerError):  # reset at the door: no answer, nothing taken
                    async with h.open_stream(target, proto, timeout=10) as fs:
                        await fs.send(msg.to_frame())
                        await fs.receive(timeout=10)
        await _relay_clients_advert(live, i)  # its own advert, relayed by a member: still no member
    after = await current_plan(live)
    assert after["epoch"] == before["epoch"] and after["coordinator"] == before["coordinator"]
    for i in range(len(sw.peer_ids)):
        log = sw.log(i)
        assert f"refused {PROTO_RING} stream from" in log and "a client may not use it" in log
        assert f"refused {PROTO_CTL} stream from" in log and f"refused {PROTO_ACT} stream from" in log
        assert "ignored an advert of" in log and "a client may not advertise" in log
    got = await assert_still_serving(live)
    assert fake.peer_id not in {p["id"] for p in live.statuses[-1]["peers_file"]["peers"]}, got


async def _relay_clients_advert(live: LiveSwarm, node: int) -> None:
    """A client connects to ``node`` and a member (a colluding admitted member host) relays the
    client's own signed advert to ``node``: the node knows that peer as a client and ignores it."""
    sw = live.swarm
    seed = os.urandom(32)
    ident = Identity(seed)
    from swarm.net.host import open_host

    async with open_host(seed, secret=client_secret(sw.secret), swarm_id=sw.swarm_id, role=CLIENT,
                         member_key=member_key(sw.secret)) as c:  # fmt: skip
        await c.dial(sw.addrs[node])
        async with admitted_attacker(live, node) as (m, peer):
            async with m.open_stream(peer, PROTO_CTL, timeout=10) as fs:
                await fs.send(_advert(ident, sw.swarm_id).to_frame())
                await trio.sleep(1.0)
            view: dict[str, Any] = await client.status(m, peer)
        assert ident.peer_id not in {p["id"] for p in view["peers_file"]["peers"]}


async def test_what_a_client_invite_holds_never_admits_as_a_member(live: LiveSwarm) -> None:
    sw = live.swarm
    # the client secret, or the member key, offered as the swarm secret
    for offered in (client_secret(sw.secret), member_key(sw.secret)):
        try:
            async with client.open_client(sw.addrs[0], secret=offered, swarm_id=sw.swarm_id, timeout=10):
                raise AssertionError("admitted as a member with what a client invite holds")
        except BaseException as exc:  # trio wraps it in exception groups
            if first_leaf(exc, AdmissionError) is None:
                raise
    await assert_still_serving(live)


async def test_generate_and_status_with_a_member_invite_act_as_a_client(live: LiveSwarm) -> None:
    """Issue 27: `generate` run with a *member* invite was admitted as a member (a throwaway
    identity holding the member credential). It now derives the client credential from the
    invite and is admitted as a client: node 0 (the invite's bootstrap) logs a new client
    admission and no new member one, and the output equals the reference."""
    sw = live.swarm
    invite = sw.workdir / "invite.json"

    def admissions(kind: str) -> int:
        lines = [ln for ln in sw.log(0).splitlines() if "admitted peer" in ln and "inbound" in ln]
        return sum((", client)" in ln) == (kind == "client") for ln in lines)

    clients, members = admissions("client"), admissions("member")
    gen = await trio.to_thread.run_sync(lambda: _cli(
        "generate", "--manifest", str(invite), "--prompt-ids", ",".join(map(str, PROMPT)),
        "--max-new-tokens", str(MAX_NEW), "--draft", "none", "--json", "--timeout", "90"))  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert json.loads(gen.stdout)["output_token_ids"] == live.reference
    st = await trio.to_thread.run_sync(lambda: _cli("status", "--manifest", str(invite), "--json", "--timeout", "30"))
    assert st.returncode == 0, st.stderr[-3000:]
    assert admissions("client") >= clients + 2, "generate/status with a member invite were not admitted as clients"
    assert admissions("member") == members, "generate/status with a member invite were admitted as members"
