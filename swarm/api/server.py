"""The OpenAI-compatible HTTP server: Starlette routes on Hypercorn's trio worker.

Theory of operation
-------------------
``serve_api`` runs Hypercorn inside the caller's ``trio.run`` (beside the libp2p host), started
with ``nursery.start``; it reports the URL it bound. Routes: ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

Every generation runs under a *disconnect watch*: one task waits for ASGI's ``http.disconnect``
while another produces the answer, and whichever ends first cancels the other. A client that
hangs up (mid-stream, or while waiting for a non-streamed answer) therefore cancels the
generation at once, and ``open_generation`` resets the gen stream so the swarm frees the
session (see backend.py). Stop sequences end a generation the same way, from our side.

Security: bound to 127.0.0.1 by default. Binding anything else needs a bearer token, which every
``/v1`` request must then present (compared in constant time); a token given for a loopback
bind is enforced too. The token never appears in logs or errors. At most MAX_CONCURRENT_REQUESTS
``/v1`` requests are in progress at once; the next is answered 429 with ``Retry-After`` at once.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from swarm.api.backend import Backend, api_error, open_generation
from swarm.api.console import console_routes, run_summary
from swarm.api.requests import ApiError, GenSpec, parse_chat, parse_completion
from swarm.api.stops import TextAssembler
from swarm.errors import SwarmError, UsageError
from swarm.node.generation.genstream import resuming
from swarm.proto.control import Gen

log = logging.getLogger("swarm.api")

DEFAULT_BIND = "127.0.0.1:8000"
MAX_BODY = 1 << 20
BODY_TIMEOUT_S = 30.0  # a body that trickles in slower than this is dropped (408)
# ... and one that trickles: after BODY_GRACE_S it must have come at MIN_BODY_RATE on average,
# with no gap over BODY_GAP_S (32 bodies sent a byte every 5 s once held every slot: 429 for all)
BODY_GRACE_S = 2.0
BODY_GAP_S = 2.0
MIN_BODY_RATE = 4096  # bytes per second
INLINE_BODY = 16 << 10  # bodies up to this are parsed on the event loop; larger ones in a thread,
# so that big prompts never hold the loop that answers the swarm's heartbeats (issue 14:
# 8 concurrent 1 MiB bodies parsed inline stalled it 3.1 s)
_PARSE_LIMITER = trio.CapacityLimiter(2)
# /v1 requests in progress at once (bodies being read, generations streaming); past it a request
# is answered 429 at once instead of queueing: past 64 a generation once waited 120 s as if the
# ring had failed. Below the node's own session capacity (capacity.py), which says 429 too.
MAX_CONCURRENT_REQUESTS = 32
RETRY_AFTER_S = 1
CREATED = int(time.time())
PROTECTED = ("/v1", "/console/feed")  # paths that need the token (the console's pages hold no data)


def parse_bind(bind: str) -> tuple[str, int]:
    """'127.0.0.1:8000', '[::1]:8000', 'localhost:0' -> (host, port)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise UsageError(f"API address {bind!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class _Auth:
    """ASGI middleware: a bearer token on every /v1 request, when a token is set."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is not None and scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
                err = ApiError("missing or wrong API key: send 'Authorization: Bearer <token>'", status=401,
                               code="invalid_api_key")  # fmt: skip
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Limit:
    """ASGI middleware: at most ``limit`` /v1 requests in progress; the next gets a 429."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        if limit < 1:
            raise UsageError(f"the API's concurrent request limit must be at least 1, got {limit}")
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            err = ApiError(f"{self.limit} requests are in progress on this endpoint (its limit); retry shortly",
                           status=429, type="requests", code="too_many_requests")  # fmt: skip
            err.retry_after_s = RETRY_AFTER_S
            await error_response(err)(scope, receive, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


async def _until_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work`` until it returns or the client hangs up; True if the client hung up before
    ``work`` returned (a disconnect after the answer is complete is no hang-up)."""
    gone = finished = False
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal gone
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone = not finished
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch)
        await work()
        finished = True
        nursery.cancel_scope.cancel()
    return gone


class SSEComment(str):
    """A line of news for the client in an event stream (``: text``), not an event."""


class _SSE(Response):
    """Server-sent events produced by ``produce(emit)``, cancelled when the client hangs up.

    The 200 and its headers go out with the first event, not before: a request refused before
    anything was emitted (``produce`` raises ApiError, e.g. a 429 with Retry-After when every
    slot and the queue are taken) is answered with its own status, as a non-streamed one is."""

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Callable[[Any], Awaitable[None]]], Awaitable[None]]) -> None:
        # no super().__init__: it would declare a Content-Length for an empty body
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]  # fmt: skip
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        refused: list[ApiError] = []

        async def start() -> None:
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def emit(obj: Any) -> None:
            await start()
            if isinstance(obj, SSEComment):
                line = " ".join(str(obj).split())
                await send({"type": "http.response.body", "body": f": {line}\n\n".encode(), "more_body": True})
                return
            data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        async def work() -> None:
            try:
                await self.produce(emit)
            except ApiError as err:
                if started:
                    raise
                refused.append(err)

        if await _until_disconnect(receive, work):
            log.info("client hung up mid-stream; generation cancelled")
            return
        if refused:
            await error_response(refused[0])(scope, receive, send)
            return
        await start()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Api:
    """The routes, bound to one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def model_card(self) -> dict[str, Any]:
        return {"id": self.backend.model_name, "object": "model", "created": CREATED, "owned_by": "shard-swarm"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.backend.model_name:
            return error_response(ApiError(f"The model {request.path_params['model']!r} does not exist", status=404,
                                           param="model", code="model_not_found"))  # fmt: skip
        return JSONResponse(self.model_card())

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    async def _handle(self, request: Request, kind: str) -> Response:
        b = self.backend

        def parse(raw: bytes) -> GenSpec:
            body = _loads(raw)
            if kind == "chat":
                return parse_chat(body, b.tokenizer, b.model_name, b.context_tokens)
            return parse_completion(body, b.tokenizer, b.model_name, b.context_tokens, b.vocab_size)

        try:
            raw = await _read_body(request)
            # JSON, chat template and tokenizer are CPU work in proportion to the body
            spec = parse(raw) if len(raw) <= INLINE_BODY else await trio.to_thread.run_sync(parse, raw, limiter=_PARSE_LIMITER)
        except ApiError as err:
            return error_response(err)
        if spec.stream:
            return _SSE(lambda emit: self._stream(spec, emit))
        result: dict[str, Any] = {}

        async def work() -> None:
            try:
                result["body"] = await self._complete(spec)
            except ApiError as err:
                result["error"] = err

        if await _until_disconnect(request.receive, work):
            log.info("client hung up before the answer; generation cancelled")
            return Response(status_code=499)
        if "error" in result:
            return error_response(result["error"])
        return JSONResponse(result["body"])

    # -- one generation -----------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.backend.tokenizer.decode(ids)

    async def _run(
        self, spec: GenSpec, on_piece: Callable[[str], Awaitable[None]],
        on_notice: Callable[[str], Awaitable[None]] | None = None,
    ) -> tuple[TextAssembler, str]:
        """Generate, feeding text pieces to ``on_piece``; return the assembler and finish reason.

        The committed tokens are kept here. When the swarm loses the generation (its coordinator
        was lost, or moved), it is resumed from the prompt plus those tokens, on whatever
        coordinator the swarm serves next (genstream.resuming, as the CLI does); ``on_notice``
        hears of it, and the receipt covers the whole run. Greedy output is then the same as
        without the loss wherever the model's arithmetic is exact enough to keep every argmax
        (fp32 here; see README, "What is promised"). Unresumable (no coordinator in time, or
        the swarm cannot hold the model): an ApiError 503 naming the reason."""
        text = TextAssembler(self._decode, spec.stops)
        committed: list[int] = []

        async def attempt(req: Gen) -> dict[str, Any] | None:
            async with open_generation(self.backend, req) as gen:
                async for ids in gen:
                    if isinstance(ids, str):
                        if on_notice is not None:
                            await on_notice(ids)
                        continue
                    committed.extend(ids)
                    piece = text.feed(ids)
                    if piece:
                        await on_piece(piece)
                    if text.stopped:
                        return None  # leaving the block cancels the generation
            return gen.receipt

        try:
            receipt = await resuming(attempt, spec.request, committed, notify=on_notice or (lambda note: None))
        except SwarmError as exc:
            raise api_error(exc) from None
        if receipt is None:
            return text, "stop"
        text.receipt = receipt
        rest = text.finish()
        if rest:
            await on_piece(rest)
        return text, "stop" if receipt.get("finish_reason") == "eos" else "length"

    def _usage(self, spec: GenSpec, text: TextAssembler) -> dict[str, int]:
        p, c = len(spec.prompt_ids), text.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def _complete(self, spec: GenSpec) -> dict[str, Any]:
        async def ignore(piece: str) -> None:
            return None

        text, finish = await self._run(spec, ignore)
        rid, head = _ids(spec)
        if spec.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text.shown},
                                      "logprobs": None, "finish_reason": finish}  # fmt: skip
        else:
            choice = {"index": 0, "text": text.shown, "logprobs": None, "finish_reason": finish}
        return {**head, "id": rid, "choices": [choice], "usage": self._usage(spec, text)}

    async def _stream(self, spec: GenSpec, emit: Callable[[Any], Awaitable[None]]) -> None:
        rid, head = _ids(spec, chunk=True)
        chat = spec.kind == "chat"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                c: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            out = {**head, "id": rid, "choices": [c]}
            if spec.include_usage:
                out["usage"] = None
            return out

        opened = False

        async def open_stream() -> None:  # with the first news: a refusal before it gets its status
            nonlocal opened
            if not opened:
                opened = True
                if chat:
                    await emit(chunk(None, None, role=True))

        async def piece(p: str) -> None:
            await open_stream()
            await emit(chunk(p, None))

        async def notice(text: str) -> None:
            await open_stream()
            await emit(SSEComment(text))  # an SSE comment: clients that do not look skip it

        try:
            text, finish = await self._run(spec, piece, notice)
        except ApiError as err:
            if not opened:
                raise  # nothing sent yet: _SSE answers with the error's status (429 + Retry-After...)
            await emit(err.body())  # headers are gone: the error travels as an event
            await emit("[DONE]")
            return
        await open_stream()
        await emit(chunk(None, finish))
        if spec.include_usage:
            await emit({**head, "id": rid, "choices": [], "usage": self._usage(spec, text),
                        "swarm": run_summary(text.receipt)})  # the web chat's tok/s and tokens per traversal
        await emit("[DONE]")


def _ids(spec: GenSpec, *, chunk: bool = False) -> tuple[str, dict[str, Any]]:
    if spec.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        return f"chatcmpl-{uuid.uuid4().hex}", {"object": obj, "created": int(time.time()), "model": spec.model,
                                                "system_fingerprint": None}  # fmt: skip
    return f"cmpl-{uuid.uuid4().hex}", {"object": "text_completion", "created": int(time.time()), "model": spec.model,
                                        "system_fingerprint": None}  # fmt: skip


async def _read_body(request: Request) -> bytes:
    """The body, at most MAX_BODY bytes (413), within BODY_TIMEOUT_S, never BODY_GAP_S without a
    byte and, after BODY_GRACE_S, at MIN_BODY_RATE bytes per second on average (408)."""
    if request.headers.get("content-length", "0").isdigit() and int(request.headers.get("content-length", "0")) > MAX_BODY:
        raise ApiError(f"the request body is over {MAX_BODY} bytes", status=413, code="request_too_large")
    parts: list[bytes] = []
    size = 0
    start = trio.current_time()
    stream = request.stream().__aiter__()
    with trio.move_on_after(BODY_TIMEOUT_S) as scope:
        while True:
            with trio.move_on_after(BODY_GAP_S) as gap:
                try:
                    part = await stream.__anext__()
                except StopAsyncIteration:
                    break
            if gap.cancelled_caught:
                raise ApiError(f"the request body stalled for {BODY_GAP_S:.0f} s", status=408, code="request_timeout")
            parts.append(part)
            size += len(part)
            if size > MAX_BODY:
                raise ApiError(f"the request body is over {MAX_BODY} bytes", status=413, code="request_too_large")
            took = trio.current_time() - start
            if took > BODY_GRACE_S and size < MIN_BODY_RATE * took:
                raise ApiError(f"the request body trickles in under {MIN_BODY_RATE} bytes/s", status=408,
                               code="request_timeout")  # fmt: skip
    if scope.cancelled_caught:
        raise ApiError(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s", status=408, code="request_timeout")
    return b"".join(parts)


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def build_app(backend: Backend, *, token: str | None = None, max_concurrent: int = MAX_CONCURRENT_REQUESTS) -> ASGIApp:
    api = Api(backend)
    app = Starlette(routes=[
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        *console_routes(backend),  # the web console at / (console.py)
    ])  # fmt: skip
    return _Auth(_Limit(app, max_concurrent), token)  # an unauthenticated request never takes a slot


def check_bind(bind: str, token: str | None) -> tuple[str, int]:
    host, port = parse_bind(bind)
    if not is_loopback(host) and not token:
        raise UsageError(f"the API would listen on {host}, beyond this machine: give it a token "
                         "(SHARD_SWARM_API_TOKEN, --api-token-file or api.token in the config file), or bind 127.0.0.1")  # fmt: skip
    return host, port


async def serve_api(
    backend: Backend, bind: str = DEFAULT_BIND, *, token: str | None = None,
    max_concurrent: int = MAX_CONCURRENT_REQUESTS, task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Serve the endpoint until cancelled; ``task_status.started(url)`` once it listens."""
    check_bind(bind, token)
    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = logging.getLogger("swarm.api.http")
    config.graceful_timeout = 1.0
    async with trio.open_nursery() as nursery:
        app: Any = build_app(backend, token=token, max_concurrent=max_concurrent)  # starlette's ASGI types vs hypercorn's: the same protocol
        binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))
        url = str(binds[0]) if binds else f"http://{bind}"
        log.info("OpenAI-compatible endpoint on %s/v1", url)
        task_status.started(url)
