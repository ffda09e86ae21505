"""The libp2p host through the real stack on loopback: Noise only, admission, clean shutdown."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from swarm.errors import AdmissionError, PeerError, UsageError
from swarm.manifest.identity import Identity
from swarm.net.host import SwarmHost, open_host
from swarm.net.libp2p_host import build_libp2p_host
from swarm.proto.frame import DType, Frame, MsgType
from swarm.proto.limits import PROTO_CTL

SECRET = b"k" * 32
SWARM = "0123456789abcdef0123456789abcdef"
LOOP = ("/ip4/127.0.0.1/tcp/0",)
pytestmark = pytest.mark.timeout(60)


def _seed(i: int) -> bytes:
    return bytes([i]) * 32


@contextlib.asynccontextmanager
async def _host(i: int, secret: bytes = SECRET, **kw: float) -> AsyncIterator[SwarmHost]:
    async with open_host(_seed(i), LOOP, secret=secret, swarm_id=SWARM, **kw) as h:  # type: ignore[arg-type]
        yield h


async def _echo(peer: str, fs) -> None:  # type: ignore[no-untyped-def]
    while True:
        f = await fs.receive(timeout=30)
        await fs.send(f)


def _all_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return sum(1 + walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


async def test_peer_id_is_the_identity_key_and_addrs_carry_it() -> None:
    ident = Identity(_seed(7))
    async with open_host(ident.seed, LOOP, secret=SECRET, swarm_id=SWARM) as h:
        assert h.peer_id == ident.peer_id
        assert h.addrs() and all(a.startswith("/ip4/127.0.0.1/tcp/") and a.endswith(f"/p2p/{ident.peer_id}") for a in h.addrs())


async def test_admitted_peers_exchange_frames_and_ping() -> None:
    async with _host(1) as a, _host(2) as b:
        a.handle(PROTO_CTL, _echo)
        with trio.fail_after(15):
            peer = await b.dial(a.addrs()[0])
        assert peer == a.peer_id
        assert b.admitted_peers() == [a.peer_id] and a.admitted_peers() == [b.peer_id]
        assert b.admission_info(a.peer_id).outbound and not a.admission_info(b.peer_id).outbound  # type: ignore[union-attr]
        async with b.open_stream(a.peer_id, PROTO_CTL) as fs:
            for i in range(5):
                reply = await fs.request(Frame(MsgType.HEARTBEAT, seq=i, meta={"t": i}), timeout=5)
                assert reply.seq == i
        rtt = await b.libp2p_ping(a.peer_id)
        assert 0 < rtt < 2.0


async def test_wrong_secret_is_refused_and_the_honest_pair_keeps_working(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="swarm")
    async with _host(1) as a, _host(2) as b, _host(3, secret=b"w" * 32) as bad:
        a.handle(PROTO_CTL, _echo)
        events = a.subscribe()
        await b.dial(a.addrs()[0])
        async with b.open_stream(a.peer_id, PROTO_CTL) as fs:
            for i in range(3):  # the intruder knocks between honest exchanges
                with pytest.raises(AdmissionError, match="does not hold this swarm's secret"):
                    await bad.dial(a.addrs()[0])
                assert (await fs.request(Frame(MsgType.HEARTBEAT, seq=i, meta={"t": i}), timeout=5)).seq == i
        with trio.fail_after(5):
            while bad.peer_id in a.connected_peers():
                await trio.sleep(0.05)
        assert a.admitted_peers() == [b.peer_id]
        assert not bad.admitted_peers()
        # The other direction: an honest node never trusts a responder without the secret.
        with pytest.raises(AdmissionError, match="does not hold this swarm's secret"):
            await b.dial(bad.addrs()[0])
        assert b.admitted_peers() == [a.peer_id] and not bad.admitted_peers()
        kinds = []
        while True:
            try:
                ev = events.receive_nowait()
            except trio.WouldBlock:
                break
            kinds.append((ev.kind, ev.peer))
        assert ("refused", bad.peer_id) in kinds and ("refused", b.peer_id) not in kinds
        refused = [r.getMessage() for r in caplog.records if "refused peer" in r.getMessage()]
        assert any(bad.peer_id in m for m in refused)
        text = caplog.text
        assert SECRET.decode() not in text and "w" * 32 not in text


async def test_streams_from_unadmitted_peers_are_refused_and_the_peer_dropped() -> None:
    """A Noise-authenticated py-libp2p host that skips admission gets no swarm protocol."""
    async with _host(1, admit_timeout=0.5) as a:
        served: list[str] = []

        async def handler(peer: str, fs) -> None:  # type: ignore[no-untyped-def]
            served.append(peer)

        a.handle(PROTO_CTL, handler)
        raw = build_libp2p_host(_seed(9), [multiaddr.Multiaddr(LOOP[0])])
        async with raw.run([multiaddr.Multiaddr(LOOP[0])]):
            try:
                with trio.fail_after(10):
                    await raw.connect(info_from_p2p_addr(multiaddr.Multiaddr(a.addrs()[0])))
                    stream = await raw.new_stream(a.libp2p.get_id(), [TProtocol(PROTO_CTL)])
                    with contextlib.suppress(Exception):
                        await stream.write(b"hello?")
                    data = b""
                    with contextlib.suppress(Exception):
                        data = await stream.read(100)
                    assert data == b""
                    while raw.get_id() in a.libp2p.get_connected_peers():  # the watchdog drops it
                        await trio.sleep(0.05)
            finally:
                await raw.close()
        assert served == []
        with pytest.raises(AdmissionError, match="not admitted"):
            async with a.open_stream(str(raw.get_id()), PROTO_CTL):
                pass


async def test_plaintext_only_dialer_cannot_connect() -> None:
    async with _host(1) as a:
        kp = create_new_key_pair(_seed(8))
        plain = new_host(
            key_pair=kp,
            sec_opt={TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)},  # type: ignore[dict-item]
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},  # type: ignore[dict-item]
        )
        async with plain.run([multiaddr.Multiaddr(LOOP[0])]):
            try:
                with pytest.raises(Exception) as info, trio.fail_after(20):
                    await plain.connect(info_from_p2p_addr(multiaddr.Multiaddr(a.addrs()[0])))
                assert not isinstance(info.value, trio.TooSlowError)
                assert plain.get_id() not in a.libp2p.get_connected_peers()
                assert a.connected_peers() == []
            finally:
                await plain.close()


async def test_close_leaves_no_tasks_connections_or_listeners() -> None:
    before = _all_tasks()
    async with _host(2) as b:
        async with _host(1) as a:
            a.handle(PROTO_CTL, _echo)
            addr = a.addrs()[0]
            await b.dial(addr)
            async with b.open_stream(a.peer_id, PROTO_CTL) as fs:
                await fs.request(Frame(MsgType.HEARTBEAT, seq=1, meta={"t": 1}), timeout=5)
        with trio.fail_after(5):  # b sees a's connection close
            while b.connected_peers():
                await trio.sleep(0.05)
        assert b.admitted_peers() == []
        with pytest.raises((AdmissionError, PeerError)):
            await b.dial(addr, timeout=3)
    await trio.sleep(0)
    assert _all_tasks() == before


async def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="32 bytes"):
        async with open_host(b"short", LOOP, secret=SECRET, swarm_id=SWARM):
            pass
    with pytest.raises(UsageError, match="not a valid multiaddr"):
        async with open_host(_seed(1), ["tcp:1234"], secret=SECRET, swarm_id=SWARM):
            pass
    with pytest.raises(UsageError, match="at least 16 bytes"):
        async with open_host(_seed(1), LOOP, secret=b"x", swarm_id=SWARM):
            pass
    async with _host(1) as a:
        with pytest.raises(UsageError, match="no /p2p/"):
            await a.dial("/ip4/127.0.0.1/tcp/1")
        with pytest.raises(UsageError, match="this node itself"):
            await a.dial(a.addrs()[0])


async def test_a_peer_that_failed_once_can_be_dialed_again_at_once() -> None:
    """py-libp2p blocks a peer for 60 s after a failed dial; a restarted peer must not wait."""
    async with _host(2) as b:
        async with _host(1) as a:
            old = a.addrs()[0]
        with pytest.raises(PeerError):
            await b.dial(old, timeout=5)
        async with _host(1) as a_again:  # same key, new port
            with trio.fail_after(10):
                assert await b.dial(a_again.addrs()[0]) == a_again.peer_id
            assert b.is_admitted(a_again.peer_id)


async def test_streams_per_peer_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer may hold only so many inbound streams at once; the rest are reset, the held ones
    keep working, and a closed one frees its slot."""
    import swarm.net.host as host_mod

    monkeypatch.setattr(host_mod, "MAX_STREAMS_PER_PEER", 3)
    async with _host(1) as a, _host(2) as b:
        a.handle(PROTO_CTL, _echo)
        await b.dial(a.addrs()[0])
        async with contextlib.AsyncExitStack() as stack:
            held = [await stack.enter_async_context(b.open_stream(a.peer_id, PROTO_CTL)) for _ in range(3)]
            for fs in held:
                await fs.send(Frame(MsgType.HEARTBEAT, meta={"n": 1}))
                assert (await fs.receive(timeout=5)).meta == {"n": 1}
            with pytest.raises(PeerError):
                async with b.open_stream(a.peer_id, PROTO_CTL) as extra:
                    await extra.send(Frame(MsgType.HEARTBEAT, meta={"n": 2}))
                    await extra.receive(timeout=5)
            await held[0].send(Frame(MsgType.HEARTBEAT, meta={"n": 3}))
            assert (await held[0].receive(timeout=5)).meta == {"n": 3}
        await trio.sleep(0.3)  # the three closed: a new stream gets a slot
        async with b.open_stream(a.peer_id, PROTO_CTL) as again:
            await again.send(Frame(MsgType.HEARTBEAT, meta={"n": 4}))
            assert (await again.receive(timeout=5)).meta == {"n": 4}


async def test_cancelling_readers_and_writers_mid_flow_keeps_the_connection() -> None:
    """Noise encrypts a frame (spending a nonce) before it writes it; a write cancelled in
    between used to desynchronise the connection's nonces and kill every stream on it. Here a
    client cancels readers (whose reads send window updates) and writers at arbitrary moments
    while data flows both ways; the one connection must keep serving."""
    import random

    payload = b"x" * 60_000  # 15000 fp32

    async def flood(peer: str, fs) -> None:  # type: ignore[no-untyped-def]
        with contextlib.suppress(PeerError):
            while True:
                await fs.send(Frame(MsgType.HEARTBEAT, meta={"n": 0}, payload=payload, dtype=DType.FP32, shape=(15000,)))

    async def sink(peer: str, fs) -> None:  # type: ignore[no-untyped-def]
        with contextlib.suppress(PeerError):
            while True:
                await fs.receive(timeout=30)

    rng = random.Random(5)
    async with _host(1) as a, _host(2) as b:
        a.handle("/test/flood/1", flood)
        a.handle("/test/sink/1", sink)
        a.handle(PROTO_CTL, _echo)
        await b.dial(a.addrs()[0])
        conn_before = b.admission_info(a.peer_id)
        for i in range(40):
            proto = "/test/flood/1" if i % 2 else "/test/sink/1"
            with trio.move_on_after(rng.uniform(0.001, 0.05)):
                async with b.open_stream(a.peer_id, proto) as fs:
                    while True:
                        if proto == "/test/flood/1":
                            await fs.receive(timeout=10)
                        else:
                            await fs.send(Frame(MsgType.HEARTBEAT, payload=payload, dtype=DType.FP32, shape=(15000,)))
        async with b.open_stream(a.peer_id, PROTO_CTL) as fs:
            reply = await fs.request(Frame(MsgType.HEARTBEAT, seq=7, meta={"t": 1}), timeout=10)
        assert reply.seq == 7
        assert b.admission_info(a.peer_id) is conn_before  # the same admitted connection, never redialed
