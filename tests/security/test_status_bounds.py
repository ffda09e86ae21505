"""What members say about themselves cannot break status (issue 27, findings 3 and 5).

A member signs 256 adverts for identities it made up, each with a 128-character device name
full of terminal escape sequences, and sends them to node 0 of the shared 3-process swarm.
Before the fix every node's status reply listed every advert's device (81 KB, over the 64 KiB
metadata cap): the reply failed, and so did ``shard-swarm generate`` at its status poll; and the
escape sequences reached ``shard-swarm status`` verbatim. Now the reply is bounded by
construction and member-supplied text is stripped of control characters: ``shard-swarm status``
(a real CLI process) answers, its output holds no escape character, and an honest generation
still equals the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import trio

from swarm import client
from swarm.manifest.identity import Identity
from swarm.proto.limits import PROTO_CTL
from swarm.proto.messages import Advert
from swarm.proto.signed import sign_advert

from .swarmkit import LiveSwarm, admitted_attacker, assert_still_serving

pytestmark = pytest.mark.slow

NASTY = "\x1b[2J\x1b]0;pwned\x07\x1b[31m" + "x" * 100 + "\r\nFAKE LOG LINE"


def _advert(ident: Identity, swarm_id: str) -> Advert:
    unsigned = Advert(peer_id="", public_key=b"", swarm_id=swarm_id, seq=1, memory_bytes=10**9,
                      device_kind="cuda", device_name=NASTY[:128], layer_us=100)  # fmt: skip
    return sign_advert(unsigned, ident)


async def test_made_up_adverts_with_long_escaped_names_do_not_break_status(live: LiveSwarm) -> None:
    sw = live.swarm
    async with admitted_attacker(live, 0) as (h, node0):
        async with h.open_stream(node0, PROTO_CTL, timeout=10) as fs:
            for _ in range(256):
                await fs.send(_advert(Identity(os.urandom(32)), sw.swarm_id).to_frame())
            await trio.sleep(2.0)
        st = await client.status(h, node0)
    assert len(json.dumps(st).encode()) < 64 * 1024
    devices = [v["device"] for v in st["peer_info"].values()]
    assert any(d.startswith("cuda:") for d in devices), "the made-up adverts never reached status"
    assert not any(c in d for d in devices for c in "\x1b\x07\r\n"), devices
    cli = await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "swarm.cli.main", "status", "--manifest", str(sw.workdir / "invite.json"),
         "--peer", sw.addrs[0], "--timeout", "60"],
        capture_output=True, text=True, timeout=180,
    ))  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert not any(c in cli.stdout for c in "\x1b\x07\r"), cli.stdout[:500]
    await assert_still_serving(live)
