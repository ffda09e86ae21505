"""The one reader of a generation's stream, the one client-side resume, the one receipt stitch.

Theory of operation
-------------------
Whoever asks a peer for a generation over ``/shard-swarm/gen/1`` (``swarm.client.generate`` for
the CLI and outside tools, the API's ``ClientBackend``, a node relaying a request to the current
coordinator, a coordinator handing a run over) reads the replies here, under one timeout rule:

- **idle**: each wait for the next frame is bounded by ``idle_s``, and *any* frame resets it:
  tokens, a long prefill's progress, and a notice alike. A notice is the serving peer saying it
  is alive and working on this request (a re-plan sends one every 2 s, resume.NOTICE_EVERY_S,
  and gives up by itself after resume.RECOVERY_TIMEOUT_S with a Fail), so silence, not the
  absence of tokens, is what means a peer is gone;
- **first**: the wait for the first frame may be longer (``first_s``): the serving peer may wait
  for a ring being set up (the request's ``wait_s``) before it says anything;
- **deadline**: an overall bound on the whole generation only where the caller gives one (a
  trio time); none by default, since a long generation that keeps streaming is healthy.

Every way it can end is a typed error naming the peer: silence is PeerTimeout, a stream cut
mid-way PeerLost (both PeerError: the generation was lost), a frame that is not a gen reply
ProtocolError (the peer broke the protocol), and a Fail the typed error it stands for
(control.FAIL_CODES), in the serving peer's own words.

Resume and receipts: the coordinator itself keeps a run across a failed *ring* (resume.py's
Resumer) and, when the next ring is coordinated elsewhere, hands it over and stitches the receipt
(service.py, with :func:`stitch_receipt`). What only a client can survive is losing the
*coordinator* (or the peer it asked): :func:`resuming` asks again from the prompt plus the tokens
committed so far, on whatever coordinator the swarm serves next, and stitches the receipt with
the same :func:`stitch_receipt`. The CLI (through ``swarm.client.generate(resume=True)``) and
the API server both resume through it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from swarm.errors import Busy, CannotServe, PeerError, PeerTimeout, ProtocolError
from swarm.model.driver import output_sha256
from swarm.node.generation.genwire import receive_message
from swarm.proto import control as ctl

log = logging.getLogger("swarm.node.generation.genstream")

RESUME_TIMEOUT_S = 60.0  # how long a lost generation is asked again without a new token
RESUME_PAUSE_S = 0.5  # between two tries
RESUME_WAIT_S = 10.0  # a retry's wait for a serving ring (the request's wait_s)

Reply = ctl.Tokens | ctl.Progress | ctl.Notice | ctl.Done


class GenSink(Protocol):
    """Where a generation's news goes as it happens (the receipt is the reader's value)."""

    async def tokens(self, ids: list[int], text: str) -> None: ...

    async def notice(self, text: str) -> None: ...

    async def progress(self, done: int, total: int) -> None: ...


class GenStream:
    """The replies to one request on a gen/1 stream ``fs`` from ``peer``, read under the rule
    in the module docstring: ``idle_s`` per frame (``first_s`` for the first, default
    ``idle_s``), and ``deadline`` (trio time) over all of them where given."""

    def __init__(self, fs: Any, peer: str, *, idle_s: float, first_s: float | None = None,
                 deadline: float | None = None) -> None:  # fmt: skip
        self.fs, self.peer = fs, peer
        self.idle_s = idle_s
        self.first_s = idle_s if first_s is None else first_s
        self.deadline = math.inf if deadline is None else deadline
        self.frames = 0  # replies read so far
        self.done = False

    async def next(self) -> Reply:
        """The next reply (Tokens, Progress, Notice, or last the Done); a Fail raises its typed
        error, anything else the errors named in the module docstring."""
        if self.done:
            raise ProtocolError(f"peer {self.peer}: the generation already ended")
        wait = self.first_s if self.frames == 0 else self.idle_s
        with trio.move_on_at(self.deadline):
            try:
                msg = await receive_message(self.fs, timeout=wait)
            except PeerTimeout:
                what = "no reply to the request" if self.frames == 0 else "nothing (no token, progress or notice)"
                raise PeerTimeout(f"peer {self.peer}: {what} for {wait:g} s on the generation stream") from None
            except ProtocolError as exc:
                raise _naming(exc, self.peer) from None
            self.frames += 1
            if isinstance(msg, ctl.Fail):
                self.done = True
                raise msg.error()  # the serving peer's own words, as they were
            if isinstance(msg, ctl.Done):
                self.done = True
            if not isinstance(msg, ctl.Tokens | ctl.Progress | ctl.Notice | ctl.Done):
                raise ProtocolError(f"peer {self.peer} sent {msg!r} during a generation, not a gen reply")
            return msg
        raise PeerTimeout(f"peer {self.peer}: the generation ran past its deadline")

    async def read(self, sink: GenSink) -> dict[str, Any]:
        """Every reply to ``sink`` as it comes; the receipt."""
        while True:
            msg = await self.next()
            if isinstance(msg, ctl.Tokens):
                await sink.tokens(list(msg.ids), msg.text)
            elif isinstance(msg, ctl.Progress):
                await sink.progress(msg.done, msg.total)
            elif isinstance(msg, ctl.Notice):
                await sink.notice(msg.text)
            else:
                return dict(msg.receipt)


def _naming(exc: ProtocolError, peer: str) -> ProtocolError:
    """``exc`` (of its own type) with the peer named, if it was not already."""
    if f"peer {peer}" in str(exc):
        return exc
    return type(exc)(f"peer {peer} broke the generation stream: {exc}")


# ---------------------------------------------------------------- resume and receipts


def stitch_receipt(receipt: dict[str, Any], n: int) -> dict[str, Any]:
    """The receipt of a run resumed after ``n`` committed tokens, over the whole run:
    ``receipt`` is the resumed request's (its prompt ended with those ``n`` tokens), so they
    move from its prompt to the front of the output, and the output's hash is taken again."""
    if n == 0:
        return dict(receipt)
    prompt = list(receipt["prompt_token_ids"])
    if n > len(prompt):
        raise ProtocolError(f"a resumed receipt's prompt has {len(prompt)} tokens, fewer than the {n} resumed after")
    out = [*prompt[len(prompt) - n:], *receipt["output_token_ids"]]
    return {**receipt, "prompt_token_ids": prompt[: len(prompt) - n], "output_token_ids": out,
            "output_sha256": output_sha256(out)}  # fmt: skip


def resumable(exc: BaseException) -> bool:
    """Whether asking again may help: the generation was lost on the way (a peer lost, silent,
    or gone), not refused (a bad request, a full swarm, one too small for the model)."""
    return isinstance(exc, PeerError) and not isinstance(exc, CannotServe | Busy)


async def resuming(
    attempt: Callable[[ctl.Gen], Awaitable[dict[str, Any] | None]], req: ctl.Gen, committed: list[int],
    *, notify: Callable[[str], Awaitable[None] | None] = lambda text: None, timeout_s: float = RESUME_TIMEOUT_S,
) -> dict[str, Any] | None:  # fmt: skip
    """One generation that survives a lost coordinator. ``attempt(request)`` runs one try and
    appends each token it commits to ``committed`` (which the caller owns and may show as it
    grows); a try that fails :func:`resumable` is made again from the prompt plus the tokens
    committed so far (``req.resumed``, waiting RESUME_WAIT_S for a serving ring), after telling
    ``notify``, until ``timeout_s`` passes with no new token. The receipt covers the whole run
    (``resumed_at_tokens`` lists where it was resumed); None where ``attempt`` returned None (its
    caller ended the generation itself)."""
    resumed_at: list[int] = []
    lost_since: float | None = None
    lost_at = -1  # tokens committed at the last loss
    while True:
        done = len(committed)
        rest = req.resumed(list(committed)) if done else req
        if resumed_at:
            rest = dataclasses.replace(rest, wait_s=max(rest.wait_s, RESUME_WAIT_S))
        try:
            receipt = await attempt(rest)
        except PeerError as exc:
            now = trio.current_time()
            if len(committed) != lost_at:  # tokens came since the last loss: its clock starts again
                lost_since, lost_at = now, len(committed)
            assert lost_since is not None
            if not resumable(exc) or now - lost_since > timeout_s or len(committed) >= req.max_new_tokens:
                raise
            note = (f"the swarm lost this generation after {len(committed)} tokens ({str(exc)[:200]}); "
                    "resuming on the next coordinator from the prompt and those tokens")  # fmt: skip
            log.info("%s", note)
            told = notify(note)
            if told is not None:
                await told
            if not resumed_at or resumed_at[-1] != len(committed):
                resumed_at.append(len(committed))
            await trio.sleep(RESUME_PAUSE_S)
            continue
        if receipt is None:
            return None
        whole = stitch_receipt(receipt, done)
        if resumed_at:
            whole["resumed_at_tokens"] = [*receipt.get("resumed_at_tokens", []), *resumed_at]
        return whole
