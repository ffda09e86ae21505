"""The direct encrypted data path: handshake, tampering, replay, stray dialers, fallback.

The control channel here is a FramedChannel over an in-memory stream pair (standing in for the
Noise-authenticated libp2p stream); the direct path is a real loopback TCP socket. A small TCP
proxy in the middle plays the attacker that flips, replays and reorders sealed frames.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Callable

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import FrameError, PeerLost, PeerTimeout, ProtocolError
from swarm.net.channel import BufferedReader, FramedChannel
from swarm.net.direct import FastChannel
from swarm.net.fastpath import (
    DirectListener,
    accept_fastpath,
    open_direct_listener,
    open_fastpath,
)
from swarm.net.sealing import (
    CIPHERS,
    DEFAULT_CIPHERS,
    MAC_LEN,
    SID_LEN,
    Hello,
    derive_keys,
    parse_address,
)

ALICE, BOB = "12D3KooWAlice", "12D3KooWBob"
HDR = struct.Struct(">IQ")


def control_pair(a_thinks_b_is: str = BOB) -> tuple[FramedChannel, FramedChannel]:
    sa, sb = trio.testing.memory_stream_pair()
    a = FramedChannel(sa, local_peer=ALICE, remote_peer=a_thinks_b_is, timeout=5)
    b = FramedChannel(sb, local_peer=BOB, remote_peer=ALICE, timeout=5)
    return a, b


async def establish(
    listener: DirectListener | None, *, a_thinks_b_is: str = BOB, **kw: object
) -> tuple[FastChannel, FastChannel]:
    ca, cb = control_pair(a_thinks_b_is)
    out: dict[str, FastChannel] = {}

    async def init() -> None:
        out["a"] = await open_fastpath(ca, timeout=5, **kw)  # type: ignore[arg-type]

    async def resp() -> None:
        ciphers = kw.get("ciphers", DEFAULT_CIPHERS)
        out["b"] = await accept_fastpath(cb, listener, timeout=5, ciphers=ciphers)  # type: ignore[arg-type]

    async with trio.open_nursery() as n:
        n.start_soon(init)
        n.start_soon(resp)
    return out["a"], out["b"]


# ---------------------------------------------------------------------- an attacker in the middle

Mutate = Callable[[int, bytes, bytes], list[bytes]]


async def _pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    while data := await src.receive_some(65536):
        await dst.send_all(data)


async def _pump_frames(src: trio.SocketStream, dst: trio.SocketStream, mutate: Mutate) -> None:
    r = BufferedReader(src, "proxy")
    await dst.send_all(await r.exactly(SID_LEN + MAC_LEN))  # the proof passes untouched
    i = 0
    while True:
        hdr = await r.exactly(HDR.size)
        (n, _ctr) = HDR.unpack(hdr)
        body = await r.exactly(n)
        for chunk in mutate(i, hdr, body):
            await dst.send_all(chunk)
        i += 1


async def serve_proxy(target: str, mutate: Mutate, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    host, port = parse_address(target)
    (lst,) = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream(host, port)
        async with trio.open_nursery() as n:

            async def run(coro_fn, *args) -> None:  # type: ignore[no-untyped-def]
                with contextlib.suppress(
                    PeerLost, trio.BrokenResourceError, trio.ClosedResourceError, OSError
                ):
                    await coro_fn(*args)
                n.cancel_scope.cancel()

            n.start_soon(run, _pump, server, client)
            n.start_soon(run, _pump_frames, client, server, mutate)
        await trio.aclose_forcefully(server)
        await trio.aclose_forcefully(client)

    async with trio.open_nursery() as n:
        task_status.started(f"127.0.0.1:{lst.socket.getsockname()[1]}")
        while True:
            n.start_soon(handle, await lst.accept())


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("cipher", sorted(c.name for c in CIPHERS.values()))
async def test_direct_round_trip_over_loopback(cipher: str) -> None:
    async with open_direct_listener() as listener:
        a, b = await establish(listener, ciphers=(cipher,))
        assert (a.path, b.path) == ("direct", "direct")
        assert a.cipher == b.cipher == cipher
        assert (a.remote_peer, b.remote_peer) == (BOB, ALICE)
        assert a.direct is not None and b.direct is not None
        assert a.direct.keys.send == b.direct.keys.recv != a.direct.keys.recv
        for size in (0, 1, 8192, 65536, 1 << 20):
            msg = os.urandom(size)
            async with trio.open_nursery() as n:  # 1 MiB exceeds the socket buffers
                n.start_soon(a.send, msg)
                assert await b.receive() == msg
            async with trio.open_nursery() as n:
                n.start_soon(b.send, msg[::-1])
                assert await a.receive() == msg[::-1]
        assert listener.accepted == 1 and listener.rejected == 0
        await a.aclose()
        with pytest.raises(PeerLost):
            await b.receive(timeout=2)


async def test_a_message_that_fits_opens_into_the_callers_buffer() -> None:
    """``receive(into=buf)``: a direct message that fits is opened in ``buf`` and comes back as
    a view of it (no copy); a larger one comes back as bytes, ``buf`` untouched."""
    async with open_direct_listener() as listener:
        a, b = await establish(listener)
        buf = bytearray(1 << 20)
        for size in (1, 8192, 1 << 20):
            msg = os.urandom(size)
            async with trio.open_nursery() as n:
                n.start_soon(a.send, msg)
                got = await b.receive(into=buf)
            assert isinstance(got, memoryview) and got.obj is buf and got == msg
        big = os.urandom((1 << 20) + 1)
        before = bytes(buf)
        async with trio.open_nursery() as n:
            n.start_soon(a.send, big)
            got = await b.receive(into=buf)
        assert isinstance(got, bytes) and got == big and buf == before


async def test_both_directions_at_once_do_not_deadlock() -> None:
    async with open_direct_listener() as listener:
        a, b = await establish(listener)
        blob = os.urandom(1 << 20)

        async def pump(src: FastChannel, dst: FastChannel) -> None:
            async with trio.open_nursery() as n:
                for _ in range(4):
                    n.start_soon(src.send, blob)  # concurrent senders share the lock
                for _ in range(4):
                    assert await dst.receive() == blob

        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                n.start_soon(pump, a, b)
                n.start_soon(pump, b, a)


async def test_keys_are_bound_to_both_peer_ids() -> None:
    c = CIPHERS[min(CIPHERS)]
    base = dict(shared=b"s" * 32, hello_i=b"hi", hello_r=b"hr", cipher=c)
    k1 = derive_keys(initiator=True, initiator_id=ALICE, responder_id=BOB, **base)  # type: ignore[arg-type]
    k2 = derive_keys(initiator=True, initiator_id=ALICE, responder_id="12D3KooWEve", **base)  # type: ignore[arg-type]
    k3 = derive_keys(initiator=True, initiator_id=BOB, responder_id=ALICE, **base)  # type: ignore[arg-type]
    assert len({k1.send, k2.send, k3.send}) == 3
    assert len({k1.proof_i, k2.proof_i, k3.proof_i}) == 3
    assert "send" not in repr(k1) and k1.send.hex() not in repr(k1)
    # end to end: if Alice's authenticated view of the peer differs, the proof cannot match
    async with open_direct_listener() as listener:
        a, b = await establish(listener, a_thinks_b_is="12D3KooWEve")
        assert (a.path, b.path) == ("libp2p", "libp2p")
        assert listener.rejected == 1 and listener.accepted == 0


@pytest.mark.parametrize(
    ("attack", "match"),
    [
        ("flip", "failed authentication"),
        ("flip_header", "counter"),
        ("replay", "replayed"),
        ("reorder", "reordered"),
    ],
)
async def test_tampering_in_transit_closes_the_channel(attack: str, match: str) -> None:
    held: list[bytes] = []

    def mutate(i: int, hdr: bytes, body: bytes) -> list[bytes]:
        if attack == "flip" and i == 1:
            body = body[:5] + bytes([body[5] ^ 0x01]) + body[6:]
        if attack == "flip_header" and i == 1:
            hdr = hdr[:-1] + bytes([hdr[-1] ^ 0x04])
        if attack == "replay" and i == 1:
            return [hdr + body, hdr + body]
        if attack == "reorder" and i == 1:
            held.append(hdr + body)
            return []
        if attack == "reorder" and i == 2:
            return [hdr + body, *held]
        return [hdr + body]

    async with open_direct_listener() as real, trio.open_nursery() as n:
        proxy_addr = await n.start(serve_proxy, real.addresses[0], mutate)
        real.addresses = (proxy_addr,)
        a, b = await establish(real)
        assert a.path == b.path == "direct"
        await a.send(b"frame zero")
        assert await b.receive() == b"frame zero"
        await a.send(b"frame one" * 100)
        await a.send(b"frame two")
        genuine = [b"frame one" * 100, b"frame two"]
        with pytest.raises(ProtocolError, match=match) as err:
            for expected in genuine:  # what does get through is genuine and in order
                assert await b.receive(timeout=3) == expected
            await b.receive(timeout=3)  # the replayed copy arrives after the original
        assert ALICE in str(err.value)
        assert b.closed
        with pytest.raises(PeerLost):
            await b.receive(timeout=1)
        n.cancel_scope.cancel()


async def test_oversized_frame_is_refused_before_allocation() -> None:
    async with open_direct_listener() as listener:
        a, b = await establish(listener, max_frame=1024)
        assert a.direct is not None
        with pytest.raises(FrameError, match="cap"):
            await a.send(b"x" * 1025)
        await a.direct.stream.send_all(HDR.pack(0xFFFF_FFF0, 0))  # a lying header, no body
        b.max_frame = 1024
        assert b.direct is not None
        b.direct.max_frame = 1024
        with pytest.raises(FrameError, match="over the cap of 1024"):
            await b.receive(timeout=2)
        assert b.closed


async def test_a_hello_is_capped_at_its_own_size_not_the_data_frame_cap() -> None:
    """Issue 14: the hello shares its channel with fallback data (16 MiB frames); a 4 MiB
    "hello" is refused on its length prefix, before anything is buffered."""
    from swarm.net.sealing import MAX_HELLO

    ca, cb = control_pair()
    async with open_direct_listener() as listener, trio.open_nursery() as n:
        n.start_soon(ca.send, b"x" * (4 << 20))  # the sender may block on the unread body
        with pytest.raises(FrameError, match=f"over the cap of {MAX_HELLO}"):
            await accept_fastpath(cb, listener, timeout=5)
        n.cancel_scope.cancel()


async def test_stray_dialers_get_nothing_and_the_listener_keeps_serving() -> None:
    async with open_direct_listener(proof_timeout=0.3) as listener:
        host, port = parse_address(listener.addresses[0])
        # 1. a wrong proof: closed without a single byte back
        s = await trio.open_tcp_stream(host, port)
        await s.send_all(os.urandom(SID_LEN + MAC_LEN))
        with trio.fail_after(2):
            assert await s.receive_some(100) == b""
        await s.aclose()
        # 2. silence: closed once the proof deadline passes
        s = await trio.open_tcp_stream(host, port)
        with trio.fail_after(2):
            assert await s.receive_some(100) == b""
        await s.aclose()
        # 3. a stolen session id with a forged MAC while a real handshake is pending
        a, b = await establish(listener)
        assert listener.rejected == 2 and listener.accepted == 1
        await a.send(b"still serving")
        assert await b.receive() == b"still serving"


async def test_fallback_when_direct_dial_is_refused() -> None:
    with socket.socket() as sock:  # a port that was just free: nobody listens there
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    async with open_direct_listener(advertise=[dead]) as listener:
        t0 = trio.current_time()
        a, b = await establish(listener, dial_timeout=2.0)
        assert trio.current_time() - t0 < 1.0  # refused is fast, no waiting out the timeout
        assert (a.path, b.path) == ("libp2p", "libp2p") and a.cipher is None
        await a.send(b"over the libp2p stream")
        assert await b.receive() == b"over the libp2p stream"
        await b.send(b"and back")
        assert await a.receive() == b"and back"


async def test_fallback_when_direct_address_black_holes() -> None:
    # a socket that completes TCP handshakes (backlog) but never answers: like a NAT'd port
    # mapping to nothing useful. The dial must give up at dial_timeout, not hang.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        hole = f"127.0.0.1:{sock.getsockname()[1]}"
        async with open_direct_listener(advertise=[hole]) as listener:
            t0 = trio.current_time()
            a, b = await establish(listener, dial_timeout=0.3)
            assert 0.25 < trio.current_time() - t0 < 2.0
            assert (a.path, b.path) == ("libp2p", "libp2p")
            await a.send(b"ok")
            assert await b.receive() == b"ok"


async def test_fallback_when_responder_has_no_listener() -> None:
    a, b = await establish(None)
    assert (a.path, b.path) == ("libp2p", "libp2p")
    await b.send(b"hi")
    assert await a.receive() == b"hi"


async def test_frozen_peer_times_out_and_the_channel_survives_a_receive_timeout() -> None:
    async with open_direct_listener() as listener:
        a, b = await establish(listener)
        with pytest.raises(PeerTimeout, match=ALICE):
            await b.receive(timeout=0.1)
        # half a frame then silence: still a timeout, and the rest of the frame resumes cleanly
        d = a.direct
        assert d is not None
        msg = b"after the pause"
        wire = bytes(d.seal(msg))  # one genuine frame, sent in two halves
        await d.stream.send_all(wire[:20])
        with pytest.raises(PeerTimeout):
            await b.receive(timeout=0.1)
        await d.stream.send_all(wire[20:])
        assert await b.receive(timeout=2) == msg
        await a.send(b"next")
        assert await b.receive(timeout=2) == b"next"


def test_hello_round_trip_and_rejections() -> None:
    h = Hello(b"e" * 32, (1, 2), ("127.0.0.1:5", "[::1]:7"))
    assert Hello.decode(h.encode(), "p") == h
    raw = h.encode()
    for bad in (raw[:-1], raw + b"x", b"XXXX" + raw[4:], raw[:4] + b"\x09" + raw[5:], b""):
        with pytest.raises(ProtocolError, match="peer p"):
            Hello.decode(bad, "p")
    with pytest.raises(ProtocolError):
        Hello.decode(Hello(b"e" * 32, (1,), ("nohost",)).encode(), "p")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_hello_decode_fuzz(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        Hello.decode(data, "fuzz")


# ---------------------------------------------------------------------- over the real libp2p host


async def _two_hosts_and_services(**service_b: object):  # type: ignore[no-untyped-def]
    from contextlib import AsyncExitStack

    from swarm.net.fastpath_host import open_fastpath_service
    from swarm.net.host import open_host

    stack = AsyncExitStack()
    secret = b"s" * 32
    ha = await stack.enter_async_context(open_host(b"\x01" * 32, secret=secret, swarm_id="fp-test"))
    hb = await stack.enter_async_context(open_host(b"\x02" * 32, secret=secret, swarm_id="fp-test"))
    fa = await stack.enter_async_context(open_fastpath_service(ha))
    fb = await stack.enter_async_context(open_fastpath_service(hb, **service_b))  # type: ignore[arg-type]
    peer_b = await ha.dial(hb.addrs()[0])
    return stack, ha, hb, fa, fb, peer_b


@pytest.mark.parametrize("direct", [True, False])
async def test_over_the_real_libp2p_host(direct: bool) -> None:
    stack, ha, hb, fa, fb, peer_b = await _two_hosts_and_services(direct=direct)
    async with stack:
        with trio.fail_after(10):
            a = await fa.dial(peer_b)
            b = await fb.incoming.receive()
        want = "direct" if direct else "libp2p"
        assert (a.path, b.path) == (want, want)
        assert (a.remote_peer, b.remote_peer) == (hb.peer_id, ha.peer_id)
        msg = os.urandom(70_000)
        async with trio.open_nursery() as n:
            n.start_soon(a.send, msg)
            assert await b.receive() == msg
        await b.send(b"pong")
        assert await a.receive() == b"pong"
        await a.aclose()
        await b.aclose()


async def test_real_host_falls_back_when_the_direct_port_is_dead() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    stack, ha, hb, fa, fb, peer_b = await _two_hosts_and_services(advertise=[dead])
    async with stack:
        with trio.fail_after(10):
            a = await fa.dial(peer_b)
            b = await fb.incoming.receive()
        assert (a.path, b.path) == ("libp2p", "libp2p")
        await a.send(b"via yamux")
        assert await b.receive() == b"via yamux"


async def test_a_peer_that_stops_reading_makes_send_time_out_not_hang() -> None:
    async with open_direct_listener() as listener:
        a, b = await establish(listener)
        blob = os.urandom(256 * 1024)
        with trio.fail_after(10), pytest.raises(PeerTimeout, match=BOB):  # b never reads
            for _ in range(400):  # far more than loopback socket buffers hold
                await a.send(blob, timeout=0.3)
        assert a.closed  # half a frame may be on the wire: the channel cannot continue
        await b.aclose()


async def test_framed_channel_caps_and_timeouts() -> None:
    ca, cb = control_pair()
    cb.max_frame = 100
    with pytest.raises(FrameError, match="cap"):
        await FramedChannel(
            trio.testing.memory_stream_pair()[0], local_peer=ALICE, remote_peer=BOB, max_frame=10
        ).send(b"x" * 11)
    with pytest.raises(PeerTimeout, match=ALICE):
        await cb.receive(timeout=0.05)
    await ca.send(b"y" * 50)
    assert await cb.receive() == b"y" * 50
    await ca.send(b"z" * 101)  # the sender's cap is larger than the receiver's
    with pytest.raises(FrameError, match="over the cap of 100"):
        await cb.receive()
    assert cb.closed


async def test_a_flood_of_silent_dialers_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loris that holds every proof slot with idle sockets only evicts itself: the oldest idle
    one is dropped for each newcomer, and an honest dialer still gets the direct path."""
    import swarm.net.fastpath as fp

    monkeypatch.setattr(fp, "MAX_UNPROVEN", 3)
    async with open_direct_listener(proof_timeout=5.0) as listener:
        host, port = parse_address(listener.addresses[0])
        silent = []
        for _ in range(3):
            silent.append(await trio.open_tcp_stream(host, port))
            await trio.sleep(0.02)  # accepted in this order
        extra = await trio.open_tcp_stream(host, port)
        with trio.fail_after(2):  # the oldest is dropped at once, long before the 5 s proof deadline
            assert await silent[0].receive_some(10) == b""
        assert listener.rejected == 1
        a, b = await establish(listener)  # every slot still held by idle sockets: evicts one more
        assert a.path == "direct" and b.path == "direct"
        assert len(listener._waiting) <= 3
        for s in [*silent, extra]:
            await s.aclose()
