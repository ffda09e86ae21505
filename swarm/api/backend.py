"""How the endpoint reaches the swarm: one generation request (``proto.control.Gen``) per answer.

Theory of operation
-------------------
Inside a node process the endpoint is a ``NodeBackend``: it calls the node's generation service
directly (``swarm.node.generation.service.GenService.generate``, which runs the coordinator's generation or relays it
to the coordinator), so any peer can serve the API and nothing is serialised on the way in. As a
client of a swarm (the demo's endpoint, tests) it is a ``ClientBackend``: the same request over
libp2p on ``/shard-swarm/gen/1`` to a peer we are a client of.

The endpoint always sends token ids (it renders the chat template and tokenizes here, with the
model's own tokenizer), so prompt token counts are exact and multi-message conversations keep
every turn. ``open_generation`` yields a :class:`Generation` of committed token ids (and the
swarm's notices); leaving the block before the receipt (a stop sequence, a client that hung up,
an error) stops the generation on the swarm: in-process its task is cancelled, over libp2p the
stream is *reset* rather than half-closed, so the serving peer's next write fails at once, which
ends its generation and frees its session on every stage.

Errors stay typed from the service (or the gen stream) to the server, where :func:`api_error`
maps each kind to its OpenAI error once (the protocol's fail codes: bad request 400, busy 429,
too small or unavailable 503; a gen stream that the swarm's side broke 502).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from swarm.api.requests import ApiError
from swarm.errors import Forbidden, ProtocolError, SwarmError
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import open_checkpoint
from swarm.node.errors_util import unwrap
from swarm.node.generation.genstream import GenStream
from swarm.node.generation.genwire import send_message
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_GEN

if TYPE_CHECKING:
    from swarm.net.host import SwarmHost
    from swarm.node.peer import Peer

log = logging.getLogger("swarm.api")

OPEN_TIMEOUT_S = 15.0
TOKEN_TIMEOUT_S = 60.0  # longest silence on a generation's stream (over libp2p; genstream.py's idle wait)
READY_WAIT_S = 10.0  # how long the serving peer may wait for the ring to come up

Event = list[int] | str | dict[str, Any]  # committed token ids, a notice, or (last) the receipt


class Backend(Protocol):
    model_name: str
    tokenizer: Tokenizer
    context_tokens: int
    vocab_size: int

    def open_generation(self, req: ctl.Gen) -> contextlib.AbstractAsyncContextManager[Generation]: ...

    async def status(self) -> dict[str, Any]:
        """The serving coordinator's status (swarm/node/generation/report.py), for the web console."""
        ...


def api_error(exc: SwarmError) -> ApiError:
    """What the client is told about an error from the swarm side (see the module docstring)."""
    if isinstance(exc, ApiError):
        return exc
    fail = ctl.fail_of(exc)
    if fail.code == "context_length_exceeded":  # the swarm's own check (service.check_context)
        return ApiError(fail.message, status=400, code="context_length_exceeded")
    if fail.code == "refused":  # a peer could not serve this request (out of memory): it alone failed
        return ApiError(f"the swarm could not serve this request: {fail.message}", status=503, type="server_error",
                        code="request_refused")  # fmt: skip
    if isinstance(exc, ProtocolError) and not isinstance(exc, Forbidden):  # the swarm's side broke the gen stream
        return ApiError(f"the swarm answered out of protocol: {exc}", status=502, type="server_error",
                        code="bad_gateway")  # fmt: skip
    if fail.code in ("bad_request", "forbidden"):
        return ApiError(fail.message, status=400, code="invalid_value")
    if fail.code == "busy":  # every slot of the ring's KV memory taken, queue full
        err = ApiError(fail.message, status=429, type="server_error", code="swarm_busy")
        err.retry_after_s = fail.retry_after_s if fail.retry_after_s is not None else 5
        return err
    if fail.code == "cannot_serve":  # the live peers cannot hold the model: no use retrying now
        return ApiError(f"the swarm cannot serve this request now: {fail.message}", status=503, type="server_error",
                        code="swarm_too_small")  # fmt: skip
    return ApiError(f"the swarm could not serve this request: {fail.message}", status=503, type="server_error",
                    code="swarm_unavailable")  # fmt: skip


@dataclass
class _ModelInfo:
    model_name: str
    tokenizer: Tokenizer
    context_tokens: int
    vocab_size: int


def _model_info(model_dir: Path, context_tokens: int | None, name: str | None) -> _ModelInfo:
    args = open_checkpoint(model_dir).args  # a directory or a .gguf
    tok = Tokenizer.load(model_dir)
    ctx = args.max_seq_len if context_tokens is None else min(context_tokens, args.max_seq_len)
    return _ModelInfo(name or model_dir.name, tok, ctx, args.vocab_size)


@dataclass
class Generation:
    """One running generation: iterate for batches of committed token ids (and notices)."""

    events: AsyncIterator[Event]
    receipt: dict[str, Any] | None = None
    ids: list[int] = field(default_factory=list)

    def __aiter__(self) -> AsyncIterator[list[int] | str]:
        return self._events()

    async def _events(self) -> AsyncIterator[list[int] | str]:
        """Batches of committed token ids, and (as str) the swarm's one-line news for the client:
        a pause for a re-plan, the resume. Errors stay typed (the server maps them, api_error)."""
        async for ev in self.events:
            if isinstance(ev, dict):
                self.receipt = ev
                return
            if isinstance(ev, str):
                log.info("swarm: %s", ev[:300])
            else:
                self.ids.extend(ev)
            yield ev
        raise ProtocolError("the swarm ended the generation without a receipt")


class NodeBackend:
    """Requests go straight into this node's own generation service (no serialisation)."""

    def __init__(self, peer: Peer, *, model_name: str | None = None) -> None:
        s = peer.settings
        if s.model_dir is None or peer.serving is None:
            raise ApiError("the API needs a node that serves (it has no model)", status=503)
        info = _model_info(s.model_dir, s.context_tokens, model_name)
        self.service = peer.serving.gen
        self.model_name, self.tokenizer = info.model_name, info.tokenizer
        self.context_tokens, self.vocab_size = info.context_tokens, info.vocab_size

    async def status(self) -> dict[str, Any]:
        return await self.service.status(ctl.Status(coordinator=True))

    @contextlib.asynccontextmanager
    async def open_generation(self, req: ctl.Gen) -> AsyncIterator[Generation]:
        send, recv = trio.open_memory_channel[Event | SwarmError](math.inf)

        class Sink:
            async def tokens(self, ids: list[int], text: str) -> None:
                send.send_nowait(list(ids))

            async def notice(self, text: str) -> None:
                send.send_nowait(text)

            async def progress(self, done: int, total: int) -> None:
                return None

        async def run() -> None:
            with send:
                try:
                    send.send_nowait(await self.service.generate(req, Sink()))
                except SwarmError as exc:
                    send.send_nowait(exc)

        async def events() -> AsyncIterator[Event]:
            async for item in recv:
                if isinstance(item, SwarmError):
                    raise item
                yield item

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                yield Generation(events())
                nursery.cancel_scope.cancel()  # done, or left early: the generation stops
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None


class ClientBackend:
    """Requests go over libp2p to ``peer`` (any member; it relays to the coordinator)."""

    def __init__(self, host: SwarmHost, peer: str, model_dir: Path, *, context_tokens: int | None = None,
                 model_name: str | None = None) -> None:  # fmt: skip
        info = _model_info(model_dir, context_tokens, model_name)
        self.host, self.peer = host, peer
        self.model_name, self.tokenizer = info.model_name, info.tokenizer
        self.context_tokens, self.vocab_size = info.context_tokens, info.vocab_size

    async def status(self) -> dict[str, Any]:
        from swarm import client

        return await client.status(self.host, self.peer, coordinator=True)

    @contextlib.asynccontextmanager
    async def open_generation(self, req: ctl.Gen) -> AsyncIterator[Generation]:
        async with self.host.open_stream(self.peer, PROTO_GEN, timeout=OPEN_TIMEOUT_S) as fs:
            gen = Generation(_frames(fs, self.peer, req))
            try:
                await send_message(fs, req, timeout=OPEN_TIMEOUT_S)
                yield gen
            finally:
                if gen.receipt is None:
                    await fs.reset()  # shielded inside; the serving peer's next write fails


async def _frames(fs: Any, peer: str, req: ctl.Gen) -> AsyncIterator[Event]:
    """A gen stream's replies as events, read by the one reader (genstream.GenStream: any frame
    ends a silence; the first may take the request's ``wait_s`` longer); a Fail raises its typed
    error, a broken stream PeerError or ProtocolError (api_error maps them)."""
    stream = GenStream(fs, peer, idle_s=TOKEN_TIMEOUT_S, first_s=TOKEN_TIMEOUT_S + req.wait_s)
    while True:
        msg = await stream.next()
        if isinstance(msg, ctl.Tokens):
            yield [int(i) for i in msg.ids]
        elif isinstance(msg, ctl.Notice):  # a pause for a re-plan: the completion carries on after it
            yield msg.text
        elif isinstance(msg, ctl.Done):
            yield dict(msg.receipt)
            return
        # a Progress (a long prefill goes on) is no event


def gen_request(req: ctl.Gen, *, wait_s: float = READY_WAIT_S) -> ctl.Gen:
    """``req`` as the endpoint sends it: token ids, and a short wait for a serving ring."""
    import dataclasses

    return dataclasses.replace(req, wait_s=wait_s)


@contextlib.asynccontextmanager
async def open_generation(backend: Backend, req: ctl.Gen) -> AsyncIterator[Generation]:
    """Start one generation; leaving the block before it is done cancels it on the swarm."""
    async with backend.open_generation(gen_request(req)) as gen:
        yield gen
