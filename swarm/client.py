"""Talking to a running swarm as a client: status, waiting for the ring, one generation.

A client is a libp2p host with a throwaway identity that proves the swarm secret (admission) but
never advertises, so the planner never counts it as a member. It dials one peer and sends
requests on ``/shard-swarm/gen/1``; any peer relays generations to the coordinator.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import trio

from swarm.errors import PeerError, PeerTimeout
from swarm.net.host import SwarmHost, open_host
from swarm.node.generation.genstream import GenStream, resuming
from swarm.node.generation.genwire import send_message
from swarm.node.hosting import Host
from swarm.node.members.heartbeat import Liveness, serve_ctl_inbound
from swarm.proto import control as ctl
from swarm.proto.admission import CLIENT, MEMBER, client_secret
from swarm.proto.admission import member_key as member_key_of
from swarm.proto.limits import PROTO_CTL, PROTO_GEN


def client_credential(secret: bytes, role: str, member_key: bytes = b"") -> tuple[bytes, str, bytes]:
    """(secret, role, member key) to run ``generate`` or ``status`` with: always a client's. A
    member invite's holder gets the client credential derived from it (issue 27: least
    privilege; a member credential would make this throwaway host a member of the swarm)."""
    if role == MEMBER:
        return client_secret(secret), CLIENT, member_key_of(secret)
    return secret, role, member_key


@contextlib.asynccontextmanager
async def open_client(
    addr: str | Sequence[str], *, secret: bytes, swarm_id: str, timeout: float = 60.0,
    role: str = "member", member_key: bytes = b"",
) -> AsyncIterator[tuple[SwarmHost, str]]:
    """A client host connected and admitted to the peer at ``addr`` (a multiaddr with /p2p/), or
    to the first of several that answers (an invite's bootstrap list: each gets an equal share
    of ``timeout``, at least 10 s). ``role="client"`` with a client invite's secret and
    ``member_key``: admitted as a client (generations and status only)."""
    async with open_host(
        os.urandom(32), ("/ip4/127.0.0.1/tcp/0",), secret=secret, swarm_id=swarm_id, role=role, member_key=member_key
    ) as host:
        liveness = Liveness()

        async def ignore_advert(peer: str, advert: Any) -> None:
            return None

        # echo the peers' heartbeats so they keep us connected; we never advertise
        host.handle(PROTO_CTL, lambda peer, fs: serve_ctl_inbound(fs, liveness, ignore_advert))
        addrs = [addr] if isinstance(addr, str) else list(addr)
        if not addrs:
            raise PeerError("no peer address to dial (the invite lists no bootstrap: give --peer MULTIADDR)")
        share = max(10.0, timeout / len(addrs)) if len(addrs) > 1 else timeout
        peer = ""
        for i, a in enumerate(addrs):
            try:
                peer = await _dial_retrying(host, a, share)
                break
            except PeerError:
                if i == len(addrs) - 1:
                    raise
        yield host, peer


async def _dial_retrying(host: SwarmHost, addr: str, timeout: float) -> str:
    """Dial until it works or ``timeout`` passes (a node that is still starting refuses)."""
    deadline = trio.current_time() + timeout
    parts = addr.split("/")
    if len(parts) > 4 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
        # libp2p remembers a failed dial for a while (its negative cache): wait until the
        # node's port answers before the first libp2p dial
        while True:
            try:
                with trio.fail_after(1.0):
                    stream = await trio.open_tcp_stream(parts[2], int(parts[4]))
                await stream.aclose()
                break
            except (OSError, trio.TooSlowError):
                if trio.current_time() >= deadline:
                    raise PeerTimeout(f"nothing listens at {addr} after {timeout:.0f} s") from None
                await trio.sleep(0.25)
    while True:
        try:
            return await host.dial(addr, timeout=max(0.5, deadline - trio.current_time()))
        except PeerError:
            if trio.current_time() + 0.5 >= deadline:
                raise
            await trio.sleep(0.5)


async def request(host: Host, peer: str, msg: ctl.Control, *, timeout: float = 15.0) -> ctl.Control:
    """One request/reply on ``/shard-swarm/gen/1`` (status); a Fail becomes its typed error."""
    async with host.open_stream(peer, PROTO_GEN, timeout=timeout) as fs:
        reply = await fs.request_message(msg, timeout=timeout, expect=ctl.Control)
    if isinstance(reply, ctl.Fail):
        raise reply.error(f"peer {peer}: ")
    return reply


async def status(host: Host, peer: str, *, coordinator: bool = False, loop_window_s: int = 60) -> dict[str, Any]:
    """What ``peer`` sees (``coordinator``: what the serving coordinator sees, relayed)."""
    reply = await request(host, peer, ctl.Status(coordinator=coordinator, loop_window_s=loop_window_s))
    return dict(ctl.expect(reply, ctl.StatusReply, peer, "status").status)


async def wait_ready(host: Host, peer: str, *, timeout: float, on_status: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Poll the coordinator's status (relayed by ``peer``) until the ring serves."""
    last: dict[str, Any] = {}
    with trio.move_on_after(timeout):
        while True:
            try:
                last = await status(host, peer, coordinator=True)
            except PeerError as exc:
                last = {"error": str(exc)}
            if on_status is not None:
                on_status(last)
            if last.get("serving"):
                return last
            await trio.sleep(0.25)
    raise PeerTimeout(f"the swarm was not ready within {timeout:.0f} s (last status: {_describe(last)})")


async def generate(
    host: Host,
    peer: str,
    *,
    text: str | None = None,
    prompt_ids: list[int] | None = None,
    chat: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    draft: str | None = None,
    depth: int | None = None,
    draft_k: int | None = None,
    wait_s: float = 0.0,
    timeout: float = 60.0,
    deadline: float | None = None,
    on_tokens: Callable[[list[int], str], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run one generation; returns the receipt. ``on_tokens(ids, text)`` streams as they commit;
    ``on_notice(text)`` gets the coordinator's one-line news (a pause for a re-plan, the resume).
    The stream is read by ``swarm.node.generation.genstream`` under its one timeout rule:
    ``timeout`` bounds each silence (any frame, a notice included, ends one; the first reply may
    take ``wait_s`` more), ``deadline`` (trio time), where given, the whole generation.
    ``resume``: a generation lost on the way (its coordinator, or ``peer``, gone) is asked again
    from the prompt plus the tokens committed so far, and the receipt covers the whole run
    (genstream.resuming). The request is checked here against the same bounds the serving peer
    applies (BadRequest naming the field)."""
    if prompt_ids is None and text is None:
        raise ValueError("give text or prompt_ids")
    req = ctl.Gen.checked(list(prompt_ids or ()), text=text if prompt_ids is None else None, chat=chat,
                          max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          draft=draft, depth=depth, draft_k=draft_k, wait_s=wait_s)  # fmt: skip
    committed: list[int] = []

    class Sink:
        async def tokens(self, ids: list[int], text: str) -> None:
            committed.extend(ids)
            if on_tokens is not None:
                on_tokens(list(ids), text)

        async def notice(self, text: str) -> None:
            if on_notice is not None:
                on_notice(text)

        async def progress(self, done: int, total: int) -> None:
            return None

    async def attempt(r: ctl.Gen) -> dict[str, Any]:
        async with host.open_stream(peer, PROTO_GEN, timeout=timeout) as fs:
            await send_message(fs, r, timeout=timeout)
            stream = GenStream(fs, peer, idle_s=timeout, first_s=timeout + r.wait_s, deadline=deadline)
            return await stream.read(Sink())

    if not resume:
        return await attempt(req)
    receipt = await resuming(attempt, req, committed, notify=on_notice or (lambda text: None))
    assert receipt is not None  # attempt always returns one
    return receipt


def _describe(st: dict[str, Any]) -> str:
    if "error" in st:
        return str(st["error"])
    return f"epoch {st.get('epoch')}, {len(st.get('members') or [])} members, serving {st.get('serving')}"
