"""How the endpoint reaches the swarm: one ``/shard-swarm/gen/1`` exchange per request.

Theory of operation
-------------------
A backend opens a gen stream to a peer that serves the generation protocol (swarm/node/
service.py): either a libp2p stream to a peer we are a client of (``ClientBackend``), or, inside
a node process, an in-memory framed pipe into the node's own service (``NodeBackend``), which
runs the coordinator's generation or relays to the coordinator, so any peer can serve the API.

The endpoint always sends token ids (it renders the chat template and tokenizes here, with the
model's own tokenizer), so prompt token counts are exact and multi-message conversations keep
every turn. ``open_generation`` sends one CONTROL ``gen`` request and yields its ``tokens``
frames; leaving the block before the ``done`` receipt (a stop sequence, a client that hung up,
an error) *resets* the stream rather than half-closing it: the serving peer's next write then
fails at once, which ends its generation and frees its session on every stage (a half-close
would let it write into our buffers until the generation ran to its end).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio
import trio.testing

from swarm.api.requests import ApiError, GenSpec
from swarm.errors import PeerError, SwarmError
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import open_checkpoint
from swarm.net.streams import TrioStreamRaw, open_framed
from swarm.proto.control import Control
from swarm.proto.frame import Frame
from swarm.proto.messages import parse_message

if TYPE_CHECKING:
    from swarm.net.host import SwarmHost
    from swarm.node.runtime import Node

log = logging.getLogger("swarm.api")

PROTO_GEN = "/shard-swarm/gen/1"
OPEN_TIMEOUT_S = 15.0
TOKEN_TIMEOUT_S = 60.0  # longest silence between two frames of one generation
READY_WAIT_S = 10.0  # how long the serving peer may wait for the ring to come up


class GenStream(Protocol):
    async def send(self, frame: Frame, timeout: float | None = None) -> None: ...

    async def receive(self, timeout: float | None = None) -> Frame: ...

    async def reset(self) -> None: ...


class Backend(Protocol):
    model_name: str
    tokenizer: Tokenizer
    context_tokens: int
    vocab_size: int

    def open_gen(self) -> contextlib.AbstractAsyncContextManager[GenStream]: ...


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


class ClientBackend:
    """Requests go over libp2p to ``peer`` (any member; it relays to the coordinator)."""

    def __init__(self, host: SwarmHost, peer: str, model_dir: Path, *, context_tokens: int | None = None,
                 model_name: str | None = None) -> None:  # fmt: skip
        info = _model_info(model_dir, context_tokens, model_name)
        self.host, self.peer = host, peer
        self.model_name, self.tokenizer = info.model_name, info.tokenizer
        self.context_tokens, self.vocab_size = info.context_tokens, info.vocab_size

    def open_gen(self) -> contextlib.AbstractAsyncContextManager[GenStream]:
        return self.host.open_stream(self.peer, PROTO_GEN, timeout=OPEN_TIMEOUT_S)


class NodeBackend:
    """Requests go into this node's own generation service through an in-memory framed pipe."""

    def __init__(self, node: Node, *, model_name: str | None = None) -> None:
        s = node.settings
        info = _model_info(s.model_dir, s.context_tokens, model_name)
        self.node = node
        self.model_name, self.tokenizer = info.model_name, info.tokenizer
        self.context_tokens, self.vocab_size = info.context_tokens, info.vocab_size

    @contextlib.asynccontextmanager
    async def open_gen(self) -> AsyncIterator[GenStream]:
        from swarm.node.service import serve_generation

        ours, theirs = trio.testing.memory_stream_pair()
        async with (
            trio.open_nursery() as nursery,
            open_framed(TrioStreamRaw(theirs), peer="local-api", protocol=PROTO_GEN) as server_fs,
        ):

            async def serve() -> None:
                with contextlib.suppress(SwarmError):
                    await serve_generation(self.node, "local-api", server_fs)

            nursery.start_soon(serve)
            async with open_framed(TrioStreamRaw(ours), peer=self.node.peer_id, protocol=PROTO_GEN) as fs:
                yield fs
            nursery.cancel_scope.deadline = trio.current_time() + 1.0  # the service sees EOF


@dataclass
class Generation:
    """One running generation: iterate for batches of committed token ids (and notices)."""

    fs: GenStream
    spec: GenSpec
    receipt: dict[str, Any] | None = None
    ids: list[int] = field(default_factory=list)

    def __aiter__(self) -> AsyncIterator[list[int] | str]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[list[int] | str]:
        """Batches of committed token ids, and (as str) the swarm's one-line news for the client:
        a pause for a re-plan, the resume."""
        timeout = TOKEN_TIMEOUT_S + READY_WAIT_S
        while self.receipt is None:
            try:
                msg = parse_message(await self.fs.receive(timeout=timeout))
            except PeerError as exc:
                raise ApiError(f"the swarm stopped answering: {exc}", status=503, type="server_error",
                               code="swarm_unavailable") from None  # fmt: skip
            timeout = TOKEN_TIMEOUT_S
            if not isinstance(msg, Control):
                raise ApiError(f"the swarm sent {type(msg).__name__} on the gen stream", status=502, type="server_error",
                               code="bad_gateway")  # fmt: skip
            if msg.op == "tokens":
                ids = [int(i) for i in msg.ids]
                self.ids.extend(ids)
                yield ids
            elif msg.op == "notice":  # a pause for a re-plan: the completion carries on after it
                text = str(msg.body.get("text", ""))[:300]
                log.info("swarm: %s", text)
                yield text
            elif msg.op == "done":
                self.receipt = dict(msg.body)
            elif msg.op == "fail":
                text = str(msg.body.get("message", "generation failed"))
                if msg.body.get("code") == "bad_request":
                    raise ApiError(text, status=400, code="invalid_value")
                if msg.body.get("code") == "busy":  # every slot of the ring's KV memory taken, queue full
                    err = ApiError(text, status=429, type="server_error", code="swarm_busy")
                    err.retry_after_s = int(msg.body.get("retry_after_s", 5))
                    raise err
                if msg.body.get("code") == "cannot_serve":  # the live peers cannot hold the model: no use retrying now
                    raise ApiError(f"the swarm cannot serve this request now: {text}", status=503, type="server_error",
                                   code="swarm_too_small")  # fmt: skip
                raise ApiError(f"the swarm could not serve this request: {text}", status=503, type="server_error",
                               code="swarm_unavailable")  # fmt: skip
            else:
                raise ApiError(f"the swarm sent an unexpected {msg.op!r} frame", status=502, type="server_error",
                               code="bad_gateway")  # fmt: skip


def gen_request(spec: GenSpec, *, wait_s: float = READY_WAIT_S) -> Control:
    body: dict[str, Any] = {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature,
                            "top_k": spec.top_k, "top_p": spec.top_p, "chat": False, "wait_s": wait_s}  # fmt: skip
    if spec.seed is not None:
        body["seed"] = spec.seed
    return Control("gen", body, tuple(spec.prompt_ids))


@contextlib.asynccontextmanager
async def open_generation(backend: Backend, spec: GenSpec) -> AsyncIterator[Generation]:
    """Start one generation; leaving the block before it is done cancels it on the swarm."""
    try:
        async with backend.open_gen() as fs:
            gen = Generation(fs, spec)
            try:
                await fs.send(gen_request(spec).to_frame(), timeout=OPEN_TIMEOUT_S)
                yield gen
            finally:
                if gen.receipt is None:
                    await fs.reset()  # shielded inside; the serving peer's next write fails
    except PeerError as exc:
        raise ApiError(f"cannot reach the swarm: {exc}", status=503, type="server_error",
                       code="swarm_unavailable") from None  # fmt: skip
