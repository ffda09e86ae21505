"""A delaying TCP proxy on loopback: WAN latency for tests and benchmarks without ``tc netem``.

Each accepted connection is forwarded to a fixed target; bytes in each direction are held for a
one-way ``delay`` (plus optional seeded ``jitter``) and then written in order, as a long TCP path
would: a segment never overtakes the one before it. Put one proxy in front of each node and every
hop into that node costs ``delay`` seconds each way.

Only ever point it at loopback or at addresses inside network namespaces the caller created.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import trio

READ_SIZE = 64 * 1024


@dataclass
class ProxyStats:
    connections: int = 0
    bytes_forwarded: int = 0
    delays: list[float] = field(default_factory=list)


class DelayProxy:
    def __init__(
        self,
        target_port: int,
        *,
        delay: float,
        jitter: float = 0.0,
        seed: int = 0,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
    ) -> None:
        if delay < 0 or jitter < 0:
            raise ValueError("delay and jitter must be >= 0")
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self.delay, self.jitter = delay, jitter
        self._rng = random.Random(seed)
        self.port = 0
        self.stats = ProxyStats()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=self.listen_host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.stats.connections += 1
        try:
            with trio.fail_after(5):
                upstream = await trio.open_tcp_stream(*self.target)
        except (OSError, trio.TooSlowError):
            await client.aclose()
            return
        async with client, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(self._pipe, client, upstream, nursery.cancel_scope)
            nursery.start_soon(self._pipe, upstream, client, nursery.cancel_scope)

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
        send, recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)
        last_due = 0.0

        async def writer() -> None:
            async for due, data in recv:
                wait = due - trio.current_time()
                if wait > 0:
                    await trio.sleep(wait)
                await dst.send_all(data)
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await dst.send_eof()

        try:
            async with trio.open_nursery() as inner:
                inner.start_soon(writer)
                async with send:
                    while True:
                        data = await src.receive_some(READ_SIZE)
                        if not data:
                            break
                        d = self.delay + (self._rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
                        due = max(last_due, trio.current_time() + max(d, 0.0))
                        last_due = due
                        self.stats.bytes_forwarded += len(data)
                        send.send_nowait((due, data))
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            scope.cancel()  # one side went away (a killed node resets): end this connection only


@contextlib.asynccontextmanager
async def open_delay_proxy(target_port: int, *, delay: float, jitter: float = 0.0, seed: int = 0) -> AsyncIterator[DelayProxy]:
    proxy = DelayProxy(target_port, delay=delay, jitter=jitter, seed=seed)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        yield proxy
        nursery.cancel_scope.cancel()


async def _serve_many(pairs: list[tuple[int, int]], delay: float, jitter: float, seed: int) -> None:
    """Bind every listener first (port 0: one the kernel picks), print the bound ports on one
    line (``ports P1 P2 ...``, in the order given) so a parent that waits for it knows they all
    listen, then serve them all."""
    bound = []
    for i, (listen, target) in enumerate(pairs):
        proxy = DelayProxy(target, delay=delay, jitter=jitter, seed=seed + i)
        listeners = await trio.open_tcp_listeners(listen, host=proxy.listen_host)
        proxy.port = listeners[0].socket.getsockname()[1]
        bound.append((proxy, listeners))
    print("ports", *(proxy.port for proxy, _ in bound), flush=True)
    async with trio.open_nursery() as nursery:
        for proxy, listeners in bound:
            nursery.start_soon(trio.serve_listeners, proxy._handle, listeners)


def main(argv: list[str]) -> int:
    """``python -m swarm.testing.delayproxy DELAY_MS [JITTER_MS] LISTEN:TARGET ...`` (loopback only;
    LISTEN 0 binds a port the kernel picks; the bound ports are printed once all listen)."""
    import sys

    if len(argv) < 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    delay = float(argv[0]) / 1000
    rest = argv[1:]
    jitter = 0.0
    if ":" not in rest[0]:
        jitter, rest = float(rest[0]) / 1000, rest[1:]
    pairs = [(int(a), int(b)) for a, b in (x.split(":") for x in rest)]
    trio.run(_serve_many, pairs, delay, jitter, 0)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
