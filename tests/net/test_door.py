"""The door of a host through the real stack on loopback: what a peer without the secret can
make it hold, roles, the py-libp2p version check, and the per-peer stream cap on fast channels.

The attackers are bare py-libp2p hosts (Noise + yamux, no admission), so they can do what an
outsider's own code could: open streams, and write raw yamux frames past a receive window.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
from collections.abc import AsyncIterator
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA, YAMUX_HEADER_FORMAT

from swarm.errors import AdmissionError, PeerError
from swarm.net import door as door_mod
from swarm.net import libp2p_patches
from swarm.net.fastpath_host import open_fastpath_service
from swarm.net.host import SwarmHost, open_host
from swarm.net.libp2p_host import build_libp2p_host
from swarm.proto.admission import CLIENT, MEMBER, client_secret, member_key
from swarm.proto.frame import Frame, MsgType

SECRET = hashlib.sha256(b"door test secret").digest()
SWARM = "0123456789abcdef0123456789abcdef"
LOOP = ("/ip4/127.0.0.1/tcp/0",)
LISTEN = multiaddr.Multiaddr(LOOP[0])
pytestmark = pytest.mark.timeout(90)


def _seed(i: int) -> bytes:
    return hashlib.sha256(b"door seed %d" % i).digest()


@contextlib.asynccontextmanager
async def _member(i: int, **kw: Any) -> AsyncIterator[SwarmHost]:
    async with open_host(_seed(i), LOOP, secret=SECRET, swarm_id=SWARM, **kw) as h:
        yield h


@contextlib.asynccontextmanager
async def _client(i: int) -> AsyncIterator[SwarmHost]:
    async with open_host(_seed(i), LOOP, secret=client_secret(SECRET), swarm_id=SWARM, role=CLIENT,
                         member_key=member_key(SECRET)) as h:  # fmt: skip
        yield h


@contextlib.asynccontextmanager
async def _outsider(i: int, victim: SwarmHost) -> AsyncIterator[Any]:
    """A bare py-libp2p host connected to ``victim`` (transport only: it never tries admission)."""
    raw = build_libp2p_host(_seed(100 + i), [LISTEN])
    async with raw.run([LISTEN]):
        try:
            with trio.fail_after(10):
                await raw.connect(info_from_p2p_addr(multiaddr.Multiaddr(victim.addrs()[0])))
            yield raw
        finally:
            with trio.move_on_after(3):
                await raw.close()


async def _echo(peer: str, fs: Any) -> None:
    while True:
        await fs.send(await fs.receive(timeout=30))


def _data_frame(stream_id: int, payload: bytes) -> bytes:
    return struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream_id, len(payload)) + payload


async def _gone(raw: Any, victim: SwarmHost, timeout: float) -> bool:
    with trio.move_on_after(timeout):
        while raw.get_id() in victim.libp2p.get_connected_peers():
            await trio.sleep(0.05)
        return True
    return False


def test_another_py_libp2p_version_is_refused_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    libp2p_patches.check_version(libp2p_patches.PINNED_VERSION)
    with pytest.raises(libp2p_patches.Libp2pVersionError, match=r"0\.9\.0 is installed.*libp2p==0\.8\.1"):
        libp2p_patches.check_version("0.9.0")
    monkeypatch.setattr(libp2p_patches, "_applied", False)
    monkeypatch.setattr(libp2p_patches, "installed_version", lambda: "0.8.2")
    with pytest.raises(libp2p_patches.Libp2pVersionError, match="pinned|0.8.1"):
        build_libp2p_host(_seed(1), [LISTEN])


async def test_sending_past_a_receive_window_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    """An identify stream the victim does not read (it waits for admission): 300 KiB in 64 KiB
    frames, past its 256 KiB window. py-libp2p 0.8.1 alone logs a warning and buffers it all."""
    caplog.set_level(logging.WARNING, "swarm")
    async with _member(1) as victim, _outsider(1, victim) as raw:
        stream = await raw.new_stream(ID.from_base58(victim.peer_id), [TProtocol(str(IDENTIFY_PROTOCOL))])
        muxed, sid = stream.muxed_conn, stream.muxed_stream.stream_id
        with contextlib.suppress(Exception):
            for _ in range(5):
                await muxed._write_frame(_data_frame(sid, b"x" * 65536))
        assert await _gone(raw, victim, 5), "the connection outlived a receive-window violation"
    assert "past the receive window" in caplog.text


async def test_a_frame_wider_than_every_window_is_refused_before_it_is_read(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "swarm")
    async with _member(1) as victim, _outsider(2, victim) as raw:
        stream = await raw.new_stream(ID.from_base58(victim.peer_id), [TProtocol(str(PING_PROTOCOL))])
        with contextlib.suppress(Exception):
            await stream.muxed_conn._write_frame(_data_frame(stream.muxed_stream.stream_id, b"y" * (1 << 20)))
        assert await _gone(raw, victim, 5)
    assert "wider than any window" in caplog.text


async def test_an_unadmitted_peer_may_open_only_a_few_streams(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "swarm")
    async with _member(1) as victim, _outsider(3, victim) as raw:
        opened = 0
        with contextlib.suppress(Exception), trio.move_on_after(10):
            for _ in range(libp2p_patches.PRE_ADMISSION_STREAMS + 4):
                await raw.new_stream(ID.from_base58(victim.peer_id), [TProtocol(str(PING_PROTOCOL))])
                opened += 1
        assert opened <= libp2p_patches.PRE_ADMISSION_STREAMS + 1
        assert await _gone(raw, victim, 5)
    assert f"more than {libp2p_patches.PRE_ADMISSION_STREAMS} streams before admission" in caplog.text


async def test_libp2p_protocols_answer_nobody_before_admission() -> None:
    """identify and ping wait for admission and are reset without a byte when it never comes."""
    async with _member(1, admit_timeout=1.0) as victim, _outsider(4, victim) as raw:
        stream = await raw.new_stream(ID.from_base58(victim.peer_id), [TProtocol(str(IDENTIFY_PROTOCOL))])
        got = b""
        with contextlib.suppress(Exception), trio.fail_after(5):
            got = await stream.read(4096)
        assert got == b"", "identify answered a peer that never proved the secret"


async def test_waiting_connections_are_bounded_and_an_honest_peer_still_gets_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(door_mod, "MAX_PENDING_ADMISSIONS", 3)
    async with _member(1, admit_timeout=20.0) as victim, contextlib.AsyncExitStack() as stack:
        raws = [await stack.enter_async_context(_outsider(10 + i, victim)) for i in range(6)]
        await trio.sleep(0.3)
        assert len(victim.door.pending()) <= 3
        assert not any(str(r.get_id()) in victim.door.pending() for r in raws[:3]), "the newest were dropped, not the oldest"
        async with _member(2) as honest:
            with trio.fail_after(10):
                assert await honest.dial(victim.addrs()[0]) == victim.peer_id
            assert victim.admitted_role(honest.peer_id) == MEMBER


async def test_a_client_gets_generations_only_and_admits_nobody() -> None:
    async with _member(1) as m, _client(2) as c, _member(3) as other:
        m.handle("/test/gen/1", _echo, roles=(MEMBER, CLIENT))
        m.handle("/test/ring/1", _echo)
        assert await c.dial(m.addrs()[0]) == m.peer_id
        assert m.admitted_role(c.peer_id) == CLIENT and c.admitted_role(m.peer_id) == MEMBER
        assert m.admitted_role("12D3KooWnobody") is None
        async with c.open_stream(m.peer_id, "/test/gen/1") as fs:
            assert (await fs.request(Frame(MsgType.HEARTBEAT, seq=1, meta={"n": 1}), timeout=5)).meta == {"n": 1}
        with pytest.raises(PeerError):
            async with c.open_stream(m.peer_id, "/test/ring/1") as fs:
                await fs.request(Frame(MsgType.HEARTBEAT, seq=2, meta={"n": 2}), timeout=5)
        assert await c.libp2p_ping(m.peer_id, timeout=5) > 0  # identify and ping stay open to clients
        # a client host never admits anyone, members included
        with pytest.raises(AdmissionError):
            await other.dial(c.addrs()[0])
        # a member is still a member
        assert await other.dial(m.addrs()[0]) == m.peer_id
        assert m.admitted_role(other.peer_id) == MEMBER


async def test_fast_channels_take_the_peers_stream_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    import swarm.net.host as host_mod

    monkeypatch.setattr(host_mod, "MAX_STREAMS_PER_PEER", 2)
    async with _member(1) as a, _member(2) as b, open_fastpath_service(a) as fa, open_fastpath_service(b, direct=False) as fb:
        await b.dial(a.addrs()[0])
        held = [await fb.dial(a.peer_id, timeout=5) for _ in range(2)]
        accepted = [await fa.incoming.receive() for _ in range(2)]
        with pytest.raises(PeerError):
            await fb.dial(a.peer_id, timeout=5)
        await accepted[0].aclose()  # a closed channel gives its slot back
        await held[0].aclose()
        again = await fb.dial(a.peer_id, timeout=5)
        await again.send(b"hello")
        assert await (await fa.incoming.receive()).receive() == b"hello"
        for ch in (*held, *accepted, again):
            await ch.aclose()
