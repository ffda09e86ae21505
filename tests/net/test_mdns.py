"""mDNS discovery: unit tests of what is announced and parsed, and a two-namespace lab.

The lab test runs real nodes (SwarmHost + zeroconf) in namespaces on one bridge that this test
builds; nothing here multicasts on the machine's own interfaces: the unit tests never start
zeroconf (a recording factory stands in for it), the lab's interfaces exist only inside its
namespaces.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from swarm.errors import UsageError
from swarm.manifest.identity import Identity
from swarm.net import mdns
from swarm.net.mdns import (
    Discovered,
    announce_addrs,
    lan_interfaces,
    open_mdns,
    parse_service,
    swarm_tag,
)
from swarm.testing.netlab import lab_unavailable_reason, lan_lab

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "net" / "lab_scripts" / "mdns_peer.py"
PEER = "12D3KooWHT9nGqYx1dwzXkKJLans48kNHALUa6jS28NYm245uyDy"
TABLE = {"lo": ["127.0.0.1"], "eth0": ["192.168.1.20"], "wlan0": ["10.0.0.7"], "docker0": []}


def test_swarm_tag_hides_the_swarm_id_and_is_stable() -> None:
    tag = swarm_tag("0123456789abcdef0123456789abcdef")
    assert len(tag) == 16 and all(c in "0123456789abcdef" for c in tag)
    assert tag == swarm_tag("0123456789abcdef0123456789abcdef")
    assert tag != swarm_tag("0123456789abcdef0123456789abcdee")
    assert "0123456789abcdef" not in tag
    with pytest.raises(UsageError):
        swarm_tag("")


def test_wildcard_listen_expands_to_chosen_interfaces_only() -> None:
    ips, port = announce_addrs(["/ip4/0.0.0.0/tcp/4001"], ["eth0"], TABLE)
    assert (ips, port) == (["192.168.1.20"], 4001)
    ips, _ = announce_addrs(["/ip4/0.0.0.0/tcp/4001"], ["eth0", "wlan0"], TABLE)
    assert ips == ["192.168.1.20", "10.0.0.7"]
    # A specific listen address on another interface is not announced.
    with pytest.raises(UsageError, match="nothing to announce"):
        announce_addrs(["/ip4/10.0.0.7/tcp/4001"], ["eth0"], TABLE)
    ips, _ = announce_addrs(["/ip4/10.0.0.7/tcp/4001"], ["wlan0"], TABLE)
    assert ips == ["10.0.0.7"]


def test_bad_interface_choices_are_refused() -> None:
    with pytest.raises(UsageError, match="at least one interface"):
        announce_addrs(["/ip4/0.0.0.0/tcp/4001"], [], TABLE)
    with pytest.raises(UsageError, match="no network interface named 'eth9'"):
        announce_addrs(["/ip4/0.0.0.0/tcp/4001"], ["eth9"], TABLE)
    with pytest.raises(UsageError, match="no IPv4"):
        announce_addrs(["/ip4/0.0.0.0/tcp/4001"], ["docker0"], TABLE)
    with pytest.raises(UsageError, match="port 0"):
        announce_addrs(["/ip4/0.0.0.0/tcp/0"], ["eth0"], TABLE)
    with pytest.raises(UsageError, match="nothing to announce"):
        announce_addrs(["/ip6/::/tcp/4001"], ["eth0"], TABLE)


def test_lan_interfaces_pick_private_ipv4_not_loopback() -> None:
    assert lan_interfaces(TABLE) == ["eth0", "wlan0"]
    assert lan_interfaces({"lo": ["127.0.0.1"], "eth0": ["8.8.4.4"]}) == []


class _Info:
    def __init__(self, props: dict[bytes, bytes | None], addrs: list[str], port: int) -> None:
        self.name = "x." + mdns.SERVICE_TYPE
        self.properties, self._addrs, self.port = props, addrs, port

    def parsed_addresses(self, version: Any = None) -> list[str]:
        return self._addrs


def test_parse_service_accepts_ours_and_rejects_the_rest() -> None:
    tag = swarm_tag("s1")
    good = {b"v": b"1", b"peer": PEER.encode(), b"swarm": tag.encode()}
    got = parse_service(_Info(good, ["192.168.1.20"], 4001), tag)
    assert got == Discovered(PEER, (f"/ip4/192.168.1.20/tcp/4001/p2p/{PEER}",))
    assert parse_service(_Info(good, ["192.168.1.20"], 4001), swarm_tag("s2")) is None
    assert parse_service(_Info({**good, b"v": b"2"}, ["192.168.1.20"], 4001), tag) is None
    assert (
        parse_service(_Info({**good, b"peer": b"not-a-peer"}, ["192.168.1.20"], 4001), tag) is None
    )
    assert parse_service(_Info(good, ["0.0.0.0"], 4001), tag) is None  # never dial 0.0.0.0
    assert parse_service(_Info(good, ["192.168.1.20"], 0), tag) is None
    assert parse_service(_Info({b"v": None}, ["192.168.1.20"], 4001), tag) is None
    many = parse_service(
        _Info(good, [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(500)], 1), tag
    )
    assert many is not None and len(many.addrs) == mdns.MAX_ADDRS


def test_records_from_the_lan_are_capped_and_aged() -> None:
    """Anyone on the LAN can announce records under our swarm's tag: a flood of 200 is kept to
    MAX_FOUND (the oldest go first), a repeat is no news, and a record not seen again expires."""
    from swarm.manifest.identity import Identity

    m = mdns.Mdns(PEER, [], [])
    ids = [Identity(bytes([i % 256, i // 256]) * 16).peer_id for i in range(200)]
    news = [m.remember(Discovered(p, (f"/ip4/10.0.0.1/tcp/1/p2p/{p}",)), float(i)) for i, p in enumerate(ids)]
    assert all(news) and len(m.found) == mdns.MAX_FOUND
    assert set(m.found) == set(ids[-mdns.MAX_FOUND:])
    last = ids[-1]
    assert not m.remember(m.found[last], 300.0)  # the same record again: no news, seen again
    assert m.remember(Discovered(PEER + "x", ()), 199.0 + mdns.FOUND_TTL_S)  # later: the rest expired
    assert set(m.found) == {last, PEER + "x"}


class _Refuse(Exception):
    pass


async def test_zeroconf_gets_exactly_the_chosen_interface_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interface choice is enforced in code: zeroconf is built with explicit addresses."""
    monkeypatch.setattr(mdns, "interface_table", lambda: TABLE)
    seen: list[dict[str, Any]] = []

    def factory(**kwargs: Any) -> Any:
        seen.append(kwargs)
        raise _Refuse  # stop before anything is sent

    with pytest.raises(_Refuse):
        async with open_mdns(
            peer_id=PEER, swarm_id="s1", listen_addrs=["/ip4/0.0.0.0/tcp/4001"],
            interfaces=["eth0"], _zeroconf_factory=factory,
        ):  # fmt: skip
            pass
    assert seen[0]["interfaces"] == ["192.168.1.20"]
    with pytest.raises(UsageError):
        async with open_mdns(
            peer_id=PEER, swarm_id="s1", listen_addrs=["/ip4/0.0.0.0/tcp/4001"],
            interfaces=[], _zeroconf_factory=factory,
        ):  # fmt: skip
            pass
    assert len(seen) == 1  # refused before zeroconf was built


_reason = lab_unavailable_reason()


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(_reason is not None, reason=f"namespace lab unavailable: {_reason}")
def test_two_namespaces_find_each_other_and_ignore_other_swarms(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    swarm_secret, other_secret = os.urandom(32).hex(), os.urandom(32).hex()
    with lan_lab(3) as lab:
        seeds = [os.urandom(32) for _ in range(3)]
        ids = [Identity(s).peer_id for s in seeds]
        procs = []
        for i, (seed, swarm, secret) in enumerate(
            zip(
                seeds,
                ["swarm-a", "swarm-a", "swarm-b"],
                [swarm_secret, swarm_secret, other_secret],
                strict=True,
            )
        ):
            procs.append(lab[f"peer{i}"].spawn(
                [sys.executable, str(SCRIPT), "--seed", seed.hex(), "--secret", secret,
                 "--swarm-id", swarm, "--interface", "eth0", "--wait", "8"], env=env,
            ))  # fmt: skip
        announced = [json.loads(p.wait_for_line("ANNOUNCED ", timeout=40)) for p in procs]
        for i, a in enumerate(announced):
            # 0.0.0.0 was expanded to the one interface's address; zeroconf bound only to it.
            assert a["addrs"] == [f"/ip4/{lab[f'peer{i}'].addr}/tcp/4001/p2p/{ids[i]}"]
            assert a["zeroconf_interfaces"] == [lab[f"peer{i}"].addr]
        for me, other in ((0, 1), (1, 0)):
            found = json.loads(procs[me].wait_for_line("FOUND ", timeout=20))
            assert found["peer"] == ids[other] and found["admitted"] is True
            assert found["addrs"] == [f"/ip4/{lab[f'peer{other}'].addr}/tcp/4001/p2p/{ids[other]}"]
            assert found["s"] < 15  # "within a few seconds" of starting, imports included
        done = [json.loads(p.wait_for_line("DONE ", timeout=20)) for p in procs]
        assert done[0] == [ids[1]] and done[1] == [ids[0]]  # swarm-b's node never showed up
        assert done[2] == []  # and it saw nobody of its own swarm
