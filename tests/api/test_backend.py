"""The endpoint as a client of a swarm (``ClientBackend``, api/backend.py) on the in-memory network
and trio's mock clock: it reads the gen stream with the one reader (node/generation/genstream.py),
so its events come in order, a notice keeps a generation alive, each way a stream can end is a
typed error that ``api_error`` makes the OpenAI error it stands for (silence 503, a broken stream
502, a full swarm 429), and the server resumes a lost generation with the one resume
(genstream.resuming), its receipt stitched over the whole run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from swarm.api.backend import TOKEN_TIMEOUT_S, ClientBackend, Generation, api_error, open_generation
from swarm.api.requests import ApiError, GenSpec
from swarm.api.server import Api
from swarm.errors import SwarmError
from swarm.model.driver import output_sha256
from swarm.node.generation.genwire import receive_message, send_message
from swarm.proto import control as ctl
from swarm.proto.frame import Frame, MsgType
from swarm.proto.limits import PROTO_GEN
from swarm.testing.memnet import MemNet

SECRET, SWARM = b"s" * 32, "0123456789abcdef0123456789abcdef"
RECEIPT = {"prompt_token_ids": [1, 2], "output_token_ids": [7, 8], "finish_reason": "length"}

Script = Callable[[Any], Awaitable[None]]


@contextlib.asynccontextmanager
async def _backend(model_dir: Path, script: Script, *, read_request: bool = True) -> AsyncIterator[tuple[ClientBackend, str]]:
    """A ClientBackend talking to a peer that answers every request with ``script(fs)`` (which
    reads the request itself unless ``read_request``)."""
    net = MemNet(delay=0.001)
    async with (
        net.open_host(b"\x01" * 32, secret=SECRET, swarm_id=SWARM) as server,
        net.open_host(b"\x02" * 32, secret=SECRET, swarm_id=SWARM) as me,
    ):

        async def serve(peer: str, fs: Any) -> None:
            if read_request:
                await fs.receive(timeout=10)
            await script(fs)

        server.handle(PROTO_GEN, serve)
        peer = await me.dial(server.addrs()[0])
        yield ClientBackend(me, peer, model_dir), peer


async def _events(gen: Generation) -> list[list[int] | str]:
    return [ev async for ev in gen]


async def _api_error(backend: ClientBackend) -> ApiError:
    """The OpenAI error one generation on ``backend`` ends in."""
    with pytest.raises(SwarmError) as err:
        async with open_generation(backend, ctl.Gen.checked([1, 2])) as gen:
            await _events(gen)
    return api_error(err.value)


async def test_tokens_and_notices_come_in_order_and_the_receipt_at_the_end(tiny_chat_dir: Path, autojump_clock: Any) -> None:
    async def script(fs: Any) -> None:
        await fs.send(ctl.Tokens((7,), "a").to_frame())
        for _ in range(40):  # 80 s of a re-plan's notices: longer than the idle wait, yet alive
            await fs.send(ctl.Notice("still waiting").to_frame())
            await trio.sleep(2)
        await fs.send(ctl.Progress(64, 100).to_frame())
        await fs.send(ctl.Tokens((8,), "b").to_frame())
        await send_message(fs, ctl.Done(RECEIPT))

    async with _backend(tiny_chat_dir, script) as (backend, _), open_generation(backend, ctl.Gen.checked([1, 2])) as gen:
        events = await _events(gen)
    assert events == [[7], *["still waiting"] * 40, [8]] and TOKEN_TIMEOUT_S < 80
    assert gen.receipt == RECEIPT and gen.ids == [7, 8]


async def test_a_silent_swarm_is_a_503_after_the_idle_wait(tiny_chat_dir: Path, autojump_clock: Any) -> None:
    async def script(fs: Any) -> None:
        await fs.send(ctl.Tokens((7,), "a").to_frame())
        await trio.sleep_forever()

    start = trio.current_time()
    async with _backend(tiny_chat_dir, script) as (backend, peer):
        err = await _api_error(backend)
    assert err.status == 503 and err.code == "swarm_unavailable" and peer in err.message
    assert TOKEN_TIMEOUT_S <= trio.current_time() - start < TOKEN_TIMEOUT_S + 1


async def test_a_malformed_reply_is_a_502_naming_the_peer(tiny_chat_dir: Path, autojump_clock: Any) -> None:
    async def script(fs: Any) -> None:
        await fs.send(Frame(MsgType.CONTROL, meta={"op": "tokens", "body": {"text": 5}}))

    async with _backend(tiny_chat_dir, script) as (backend, peer):
        err = await _api_error(backend)
    assert err.status == 502 and err.code == "bad_gateway" and peer in err.message


async def test_a_full_swarm_is_a_429_with_its_retry_after(tiny_chat_dir: Path, autojump_clock: Any) -> None:
    async def script(fs: Any) -> None:
        await fs.send(ctl.Fail("busy", "every slot is taken", 7).to_frame())

    async with _backend(tiny_chat_dir, script) as (backend, _):
        err = await _api_error(backend)
    assert err.status == 429 and err.retry_after_s == 7 and "every slot" in err.message


async def test_the_server_resumes_a_lost_generation_and_stitches_its_receipt(tiny_chat_dir: Path, autojump_clock: Any) -> None:
    out = [40, 41, 42, 43, 44]  # the whole output, as one box would write it
    asked: list[ctl.Gen] = []

    async def script(fs: Any) -> None:  # the first coordinator is lost after two tokens
        req = asked[-1]
        start = len(req.ids) - 2
        for i in range(start, start + req.max_new_tokens):
            if len(asked) == 1 and i == 2:
                await trio.sleep(1)  # the two tokens arrive; then the stream is reset (a killed peer)
                await fs.reset()
                return
            await fs.send(ctl.Tokens((out[i],), "").to_frame())
        await send_message(fs, ctl.Done({"prompt_token_ids": list(req.ids), "output_token_ids": out[start:],
                                         "output_sha256": "x", "finish_reason": "length"}))  # fmt: skip

    async def serve(fs: Any) -> None:
        asked.append(await receive_message(fs))  # type: ignore[arg-type]
        await script(fs)

    pieces: list[str] = []
    notes: list[str] = []

    async def on_piece(piece: str) -> None:
        pieces.append(piece)

    async def on_notice(note: str) -> None:
        notes.append(note)

    spec = GenSpec("completion", "tiny-chat", ctl.Gen.checked([1, 2], max_new_tokens=5), (), True, False)
    async with _backend(tiny_chat_dir, serve, read_request=False) as (backend, _):
        text, finish = await Api(backend)._run(spec, on_piece, on_notice)
    assert [list(r.ids) for r in asked] == [[1, 2], [1, 2, 40, 41]] and asked[1].max_new_tokens == 3
    assert text.ids == out and "".join(pieces) == backend.tokenizer.decode(out) and finish == "length"
    assert len(notes) == 1 and "after 2 tokens" in notes[0] and "resuming on the next coordinator" in notes[0]
    receipt = text.receipt
    assert receipt is not None and receipt["prompt_token_ids"] == [1, 2] and receipt["output_token_ids"] == out
    assert receipt["output_sha256"] == output_sha256(out) and receipt["resumed_at_tokens"] == [2]
