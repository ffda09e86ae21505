"""The one reader of a generation's stream (node/generation/genstream.py), on the in-memory network
and trio's mock clock: its timeout rule (a silent peer times out, any frame, a notice included,
keeps it alive, the first reply may take longer, a caller's deadline bounds the whole), its errors
(a malformed or foreign frame names the peer, a cut mid-stream is a lost peer, a Fail its typed
error), and the client-side resume and receipt stitch built on it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from swarm.errors import Busy, CannotServe, PeerError, PeerLost, PeerTimeout, ProtocolError
from swarm.model.driver import output_sha256
from swarm.node.generation.genstream import GenStream, resuming, stitch_receipt
from swarm.node.generation.genwire import send_message
from swarm.proto import control as ctl
from swarm.proto.frame import Frame, MsgType
from swarm.proto.limits import PROTO_GEN
from swarm.testing.memnet import MemNet

SECRET, SWARM = b"s" * 32, "0123456789abcdef0123456789abcdef"
RECEIPT = {"prompt_token_ids": [1, 2], "output_token_ids": [7, 8], "output_sha256": output_sha256([7, 8])}

Script = Callable[[Any, MemNet, str], Awaitable[None]]


@contextlib.asynccontextmanager
async def _stream(script: Script) -> AsyncIterator[tuple[Any, str]]:
    """A client's gen/1 stream to a peer that answers the request with ``script(fs, net, client)``."""
    net = MemNet(delay=0.001)
    async with (
        net.open_host(b"\x01" * 32, secret=SECRET, swarm_id=SWARM) as server,
        net.open_host(b"\x02" * 32, secret=SECRET, swarm_id=SWARM) as me,
    ):

        async def serve(peer: str, fs: Any) -> None:
            await fs.receive(timeout=10)  # the request
            await script(fs, net, peer)

        server.handle(PROTO_GEN, serve)
        peer = await me.dial(server.addrs()[0])
        async with me.open_stream(peer, PROTO_GEN, timeout=5) as fs:
            await send_message(fs, ctl.Gen.checked([1, 2], max_new_tokens=2))
            yield fs, peer


class Sink:
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    async def tokens(self, ids: list[int], text: str) -> None:
        self.seen.append(("tokens", (ids, text)))

    async def notice(self, text: str) -> None:
        self.seen.append(("notice", text))

    async def progress(self, done: int, total: int) -> None:
        self.seen.append(("progress", (done, total)))


async def test_every_reply_reaches_the_sink_in_order_and_the_receipt_is_returned(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        for msg in (ctl.Progress(64, 100), ctl.Tokens((7,), "a"), ctl.Notice("paused"), ctl.Tokens((8,), "b")):
            await fs.send(msg.to_frame())
        await send_message(fs, ctl.Done(RECEIPT))

    sink = Sink()
    async with _stream(script) as (fs, peer):
        assert await GenStream(fs, peer, idle_s=5).read(sink) == RECEIPT
    assert sink.seen == [("progress", (64, 100)), ("tokens", ([7], "a")), ("notice", "paused"), ("tokens", ([8], "b"))]


async def test_a_silent_peer_times_out_after_the_idle_wait_naming_it(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        await fs.send(ctl.Tokens((7,), "a").to_frame())
        await trio.sleep_forever()

    async with _stream(script) as (fs, peer):
        stream = GenStream(fs, peer, idle_s=5)
        start = trio.current_time()
        with pytest.raises(PeerTimeout, match=f"peer {peer}: nothing .* for 5 s"):
            await stream.read(Sink())
        assert 5 <= trio.current_time() - start < 5.5  # the token at ~0 s, then 5 s of silence


async def test_notices_keep_a_stream_alive_past_the_idle_wait(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        for i in range(10):  # a re-plan's notices every 2 s: 20 s without a token
            await fs.send(ctl.Notice(f"still waiting ({2 * i} s)").to_frame())
            await trio.sleep(2)
        await fs.send(ctl.Tokens((7,), "a").to_frame())
        await send_message(fs, ctl.Done(RECEIPT))

    sink = Sink()
    async with _stream(script) as (fs, peer):
        assert await GenStream(fs, peer, idle_s=5).read(sink) == RECEIPT
    assert [k for k, _ in sink.seen] == ["notice"] * 10 + ["tokens"]


async def test_the_first_reply_may_take_first_s_and_later_ones_only_idle_s(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        await trio.sleep(12)  # the serving peer waits for its ring (wait_s)
        await fs.send(ctl.Tokens((7,), "a").to_frame())
        await trio.sleep(6)
        await send_message(fs, ctl.Done(RECEIPT))

    async with _stream(script) as (fs, peer):
        stream = GenStream(fs, peer, idle_s=5, first_s=15)
        assert isinstance(await stream.next(), ctl.Tokens)
        with pytest.raises(PeerTimeout, match="nothing .* for 5 s"):
            await stream.next()
    async with _stream(script) as (fs, peer):
        with pytest.raises(PeerTimeout, match=f"peer {peer}: no reply to the request for 5 s"):
            await GenStream(fs, peer, idle_s=5).next()


async def test_a_deadline_bounds_a_stream_that_keeps_talking(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        while True:
            await fs.send(ctl.Notice("still waiting").to_frame())
            await trio.sleep(1)

    async with _stream(script) as (fs, peer):
        start = trio.current_time()
        with pytest.raises(PeerTimeout, match=f"peer {peer}: the generation ran past its deadline"):
            await GenStream(fs, peer, idle_s=5, deadline=start + 30).read(Sink())
        assert trio.current_time() - start == pytest.approx(30, abs=0.01)


async def test_a_malformed_frame_is_a_protocol_error_naming_the_peer(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        await fs.send(ctl.Tokens((7,), "a").to_frame())
        await fs.send(Frame(MsgType.CONTROL, meta={"op": "tokens", "body": {"text": 5}}))

    async with _stream(script) as (fs, peer):
        # the stream names the peer, itself and the field (swarm.proto.messages.expect_message)
        with pytest.raises(ProtocolError, match=f"peer {peer} on /shard-swarm/gen/1: CONTROL tokens field 'text'"):
            await GenStream(fs, peer, idle_s=5).read(Sink())


async def test_a_message_that_is_no_gen_reply_is_a_protocol_error_naming_the_peer(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        await fs.send(ctl.Status(coordinator=True).to_frame())

    async with _stream(script) as (fs, peer):
        with pytest.raises(ProtocolError, match=f"peer {peer} sent .*Status.* not a gen reply"):
            await GenStream(fs, peer, idle_s=5).read(Sink())


async def test_a_cut_mid_stream_is_a_lost_peer_after_the_tokens_before_it(autojump_clock: Any) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        await fs.send(ctl.Tokens((7,), "a").to_frame())
        await trio.sleep(1)
        net.cut(client, next(p for p in net.hosts if p != client))

    sink = Sink()
    async with _stream(script) as (fs, peer):
        start = trio.current_time()
        with pytest.raises(PeerLost, match=peer):
            await GenStream(fs, peer, idle_s=60).read(sink)
        assert trio.current_time() - start < 2  # at the cut, not after the idle wait
    assert sink.seen == [("tokens", ([7], "a"))]


@pytest.mark.parametrize(("fail", "kind"), [
    (ctl.Fail("cannot_serve", "3 GB missing"), CannotServe),
    (ctl.Fail("busy", "full", 7), Busy),
    (ctl.Fail("unavailable", "a peer was lost"), PeerError),
])  # fmt: skip
async def test_a_fail_is_its_typed_error_in_the_peers_words(autojump_clock: Any, fail: ctl.Fail, kind: type) -> None:
    async def script(fs: Any, net: MemNet, client: str) -> None:
        await fs.send(fail.to_frame())

    async with _stream(script) as (fs, peer):
        with pytest.raises(kind) as err:
            await GenStream(fs, peer, idle_s=5).read(Sink())
    assert type(err.value) is kind and str(err.value) == fail.message


# ---------------------------------------------------------------- resume and receipts


def test_a_stitched_receipt_moves_the_resumed_tokens_from_the_prompt_to_the_output() -> None:
    rest = {"prompt_token_ids": [1, 2, 7, 8], "output_token_ids": [9], "output_sha256": "x", "tokens_per_s": 3.0}
    whole = stitch_receipt(rest, 2)
    assert whole["prompt_token_ids"] == [1, 2] and whole["output_token_ids"] == [7, 8, 9]
    assert whole["output_sha256"] == output_sha256([7, 8, 9]) and whole["tokens_per_s"] == 3.0
    assert stitch_receipt(rest, 0) == rest
    with pytest.raises(ProtocolError, match="fewer than the 5"):
        stitch_receipt(rest, 5)


class FakeSwarm:
    """``attempt``s against a swarm that loses the generation at the given token counts."""

    def __init__(self, lose_at: list[int], error: PeerError | None = None, out: tuple[int, ...] = (7, 8, 9, 10)) -> None:
        self.lose_at, self.error, self.out = list(lose_at), error, out
        self.asked: list[ctl.Gen] = []
        self.committed: list[int] = []

    async def attempt(self, req: ctl.Gen) -> dict[str, Any]:
        self.asked.append(req)
        await trio.sleep(1)
        start = len(req.ids) - 2  # the prompt is [1, 2]
        for i in range(start, start + req.max_new_tokens):
            if self.lose_at and i == self.lose_at[0]:
                self.lose_at.pop(0)
                raise self.error or PeerLost(f"peer C{i}: gen/1 stream reset")
            self.committed.append(self.out[i])
            await trio.sleep(1)
        return {"prompt_token_ids": list(req.ids), "output_token_ids": list(self.out[start:]), "output_sha256": "x"}


async def test_a_lost_generation_is_resumed_from_the_committed_tokens_and_the_receipt_covers_it_all(
    autojump_clock: Any,
) -> None:
    swarm = FakeSwarm(lose_at=[1, 3])
    notes: list[str] = []
    receipt = await resuming(swarm.attempt, ctl.Gen.checked([1, 2], max_new_tokens=4), swarm.committed,
                             notify=notes.append)  # fmt: skip
    assert receipt is not None
    assert [list(r.ids) for r in swarm.asked] == [[1, 2], [1, 2, 7], [1, 2, 7, 8, 9]]
    assert [r.max_new_tokens for r in swarm.asked] == [4, 3, 1] and swarm.asked[1].wait_s >= 10
    assert receipt["prompt_token_ids"] == [1, 2] and receipt["output_token_ids"] == [7, 8, 9, 10]
    assert receipt["output_sha256"] == output_sha256([7, 8, 9, 10]) and receipt["resumed_at_tokens"] == [1, 3]
    assert len(notes) == 2 and "after 1 tokens" in notes[0] and "C1" in notes[0]


@pytest.mark.parametrize("error", [CannotServe("3 GB missing"), Busy("full", 5)])
async def test_a_refusal_is_not_resumed(autojump_clock: Any, error: PeerError) -> None:
    swarm = FakeSwarm(lose_at=[1], error=error)
    with pytest.raises(type(error)):
        await resuming(swarm.attempt, ctl.Gen.checked([1, 2], max_new_tokens=4), swarm.committed)
    assert len(swarm.asked) == 1


async def test_resuming_gives_up_when_no_token_comes_for_the_resume_timeout(autojump_clock: Any) -> None:
    swarm = FakeSwarm(lose_at=[1] * 1000)
    start = trio.current_time()
    with pytest.raises(PeerLost):
        await resuming(swarm.attempt, ctl.Gen.checked([1, 2], max_new_tokens=4), swarm.committed, timeout_s=20)
    assert 20 <= trio.current_time() - start <= 23 and swarm.committed == [7]  # each try: 1 s, then 0.5 s apart
