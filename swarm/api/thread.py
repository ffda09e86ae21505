"""The endpoint served from a thread, for synchronous programs: browser tests, benchmarks.

``ThreadedApi(swarm_addr, secret, swarm_id, model_dir)`` starts its own ``trio.run`` in a
thread: a libp2p client of one peer (``ClientBackend``, as the demo's endpoint) and the API with
the web console on it. ``start()`` returns once it listens (its URL); ``stop()`` cancels it and
joins the thread. ``native_id`` names the thread, so a benchmark can read its CPU time from
``/proc/self/task/<id>/stat``.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any

import trio

from swarm import client
from swarm.api.backend import ClientBackend
from swarm.api.server import serve_api
from swarm.errors import SwarmError

START_TIMEOUT_S = 120.0


class ThreadedApi:
    def __init__(self, addr: str, secret: bytes, swarm_id: str, model_dir: Path, *, token: str | None = None,
                 bind: str = "127.0.0.1:0", context_tokens: int | None = None) -> None:  # fmt: skip
        self.addr, self.secret, self.swarm_id, self.model_dir = addr, secret, swarm_id, model_dir
        self.token, self.bind, self.context_tokens = token, bind, context_tokens
        self.url: str | None = None
        self.native_id: int | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: Any = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._run, name="console-api", daemon=True)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the API did not listen within {START_TIMEOUT_S:.0f} s")
        if self._error is not None or self.url is None:
            raise RuntimeError(f"the API did not start: {self._error!r}")
        return self.url

    def stop(self) -> None:
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(trio.RunFinishedError):  # it ended on its own
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        try:
            trio.run(self._main)
        except (SwarmError, OSError) as exc:
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._scope = scope
            async with client.open_client(self.addr, secret=self.secret, swarm_id=self.swarm_id) as (host, peer):
                backend = ClientBackend(host, peer, self.model_dir, context_tokens=self.context_tokens)
                async with trio.open_nursery() as nursery:
                    self.url = await nursery.start(lambda task_status: serve_api(backend, self.bind, token=self.token,
                                                                                 task_status=task_status))  # fmt: skip
                    self._ready.set()
                    await trio.sleep_forever()
