"""The generation service: requests in, tokens and a receipt out, in-process or on ``gen/1``.

A request is one :class:`~swarm.proto.control.Gen` (prompt ids, or text that the coordinator
tokenizes, with or without the chat template), already checked against its bounds where it was
made or decoded. :meth:`GenService.generate` serves it on this node, whatever the caller: the
coordinator runs it and streams its tokens to a :class:`GenSink` as they commit, and returns the
run receipt; a peer that is not the coordinator relays it there over ``/shard-swarm/gen/1``
(reading the coordinator's replies with the one reader of a gen stream, genstream.py), so users
can point their tools at their own machine. The API server of this node calls
``generate`` directly; :meth:`GenService.serve` is the same service for a client on the network
(``shard-swarm generate``, the demo, a relaying peer): a ``gen`` or ``status`` request in,
``tokens`` and ``notice`` frames and one ``done`` (the receipt) or ``status_reply`` out. Anything
that cannot be served is answered with a typed ``fail`` (control.fail_of), never by silence:
every wait here has a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from swarm.errors import (
    ContextTooLong,
    FrameError,
    PeerError,
    PeerLost,
    PlanningError,
    ProtocolError,
    SwarmError,
    UsageError,
)
from swarm.model.sampling import SamplingParams
from swarm.node.compute.drafting import RingTimes
from swarm.node.compute.runtime import Models
from swarm.node.dispatch import Dispatcher
from swarm.node.errors_util import unwrap
from swarm.node.generation.genstream import GenSink, GenStream, stitch_receipt
from swarm.node.generation.genwire import send_message
from swarm.node.generation.report import Reporter, replay_note
from swarm.node.generation.resume import CoordinatorMoved, Resumer
from swarm.node.hosting import Host, Stream
from swarm.node.members.view import MemberView
from swarm.node.plan.epochs import Epoch, Epochs
from swarm.node.ring.capacity import SlotQueue
from swarm.node.settings import NodeSettings
from swarm.planner import Plan
from swarm.proto import control as ctl
from swarm.proto.control import MAX_DEPTH, Gen
from swarm.proto.limits import PROTO_GEN
from swarm.proto.parts import Assembler

log = logging.getLogger("swarm.node.generation.service")

REQUEST_TIMEOUT_S = 20.0
HAND_OVER_WAIT_S = 30.0  # how long the coordinator a run is handed over to may wait for its ring
PROGRESS_EVERY_S = 2.0  # how often a long prefill tells its client how far it got


class _StreamSink:
    """A client on a gen stream: tokens, notices and progress as their messages."""

    def __init__(self, fs: Stream) -> None:
        self.fs = fs

    async def tokens(self, ids: list[int], text: str) -> None:
        await self.fs.send_message(ctl.Tokens(tuple(ids), text))

    async def notice(self, text: str) -> None:
        await self.fs.send_message(ctl.Notice(text[:1000]))

    async def progress(self, done: int, total: int) -> None:
        await self.fs.send_message(ctl.Progress(done, total))


def sampling_of(req: Gen) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed or 0)


class GenService:
    def __init__(
        self, settings: NodeSettings, peer_id: str, host: Host, view: MemberView, epochs: Epochs, models: Models,
        admission: SlotQueue, reporter: Reporter, resumer: Resumer, roles: Dispatcher,
        *, planning_problem: Callable[[], str | None],
    ) -> None:  # fmt: skip
        self.settings = settings
        self.peer_id = peer_id
        self.host = host
        self.view = view
        self.epochs = epochs
        self.models = models
        self.admission = admission
        self.reporter = reporter
        self.resumer = resumer
        self.roles = roles
        self.planning_problem = planning_problem

    # -- the network service ---------------------------------------------------------------

    async def serve(self, peer: str, fs: Stream) -> None:
        """``/shard-swarm/gen/1``: one ``gen`` or ``status`` request from ``peer`` (a long prompt
        after its parts). A frame that breaks the wire protocol is not answered: it ends the
        stream (and the host drops its sender); a bad message, or an error of our own, is answered
        with a Fail."""
        joined, msg = Assembler(), None
        while msg is None:
            try:
                msg = joined.feed(await fs.receive_message(timeout=REQUEST_TIMEOUT_S))
            except (FrameError, PeerError):
                raise  # a broken or silent stream: see above
            except SwarmError as exc:
                log.info("request from %s failed: %s", peer, exc)
                await fs.send_message(ctl.fail_of(exc))
                return
        try:
            if not isinstance(msg, Gen | ctl.Status):
                raise ProtocolError(f"expected a gen or status request, got {msg!r}")
            self.roles.check(peer, msg)
            if isinstance(msg, ctl.Status):
                await fs.send_message(ctl.StatusReply(await self.status(msg)))
                return
            receipt = await _until_hung_up(fs, lambda: self.generate(msg, _StreamSink(fs)))
            await send_message(fs, ctl.Done(receipt))
        except SwarmError as exc:
            log.info("request from %s failed: %s", peer, exc)
            await fs.send_message(ctl.fail_of(exc))
        except Exception as exc:  # a bug here: its client is told so, never left with a bare closed stream
            log.exception("request from %s crashed", peer)
            await fs.send_message(ctl.fail_of(PeerError(
                f"peer {self.peer_id} hit an internal error serving the request ({type(exc).__name__}: {exc}); "
                "its log has the traceback"
            )))  # fmt: skip

    async def status(self, req: ctl.Status) -> dict[str, Any]:
        """This node's status, or (``req.coordinator``) the serving coordinator's, relayed."""
        ep = self.epochs.serving
        if req.coordinator and ep is not None and ep.plan.coordinator != self.peer_id:
            coordinator = ep.plan.coordinator
            async with self.host.open_stream(coordinator, PROTO_GEN, timeout=REQUEST_TIMEOUT_S) as up:
                status = ctl.Status(coordinator=True, loop_window_s=req.loop_window_s)
                reply = await up.request_message(status, timeout=REQUEST_TIMEOUT_S)
            return dict(ctl.expect(reply, ctl.StatusReply, coordinator, "status").status)
        return self.reporter.status(loop_window_s=req.loop_window_s)

    # -- one generation ------------------------------------------------------------------

    async def generate(self, req: Gen, sink: GenSink) -> dict[str, Any]:
        """Serve ``req`` from this node: run it here if we coordinate the serving ring, else relay
        it to the coordinator; its tokens go to ``sink``, its receipt is returned. Cancelling the
        call stops the generation (on every stage, or at the coordinator we relay to)."""
        ep = await self._serving_epoch(req.wait_s)
        if ep.plan.coordinator != self.peer_id:
            return await self._relay(ep.plan.coordinator, req, sink)
        return await self._generate(ep, req, sink)

    async def _serving_epoch(self, wait_s: float) -> Epoch:
        def ready() -> Epoch | None:
            ep = self.epochs.serving
            if ep is not None and (ep.plan.coordinator != self.peer_id or ep.serving.is_set()):
                return ep
            return None

        ep = await self.epochs.wait_for(ready, wait_s)
        if ep is not None:
            return ep
        problem = self.planning_problem()
        if problem is not None:
            raise PlanningError(f"the swarm cannot serve: {problem}; it keeps waiting for peers")
        cur = self.epochs.current
        state = "no plan yet" if cur is None else f"epoch {cur.plan.epoch} not serving"
        raise PeerError(f"the swarm is not ready ({state}); retry in a few seconds")

    async def _relay(self, coordinator: str, req: Gen, sink: GenSink) -> dict[str, Any]:
        """Pass ``req`` to the coordinator and its news back to ``sink``; its receipt. The
        coordinator's stream is read by the one reader (genstream.py): a silence of the chunk
        timeout and 5 s more (the first reply: and the request's ``wait_s``) ends it, any frame
        (a re-plan's notices too) does not; a Fail is raised in the coordinator's own words."""
        idle = self.settings.chunk_timeout + 5
        async with self.host.open_stream(coordinator, PROTO_GEN, timeout=REQUEST_TIMEOUT_S) as up:
            stream = GenStream(up, coordinator, idle_s=idle, first_s=idle + req.wait_s)
            try:
                await send_message(up, req, timeout=REQUEST_TIMEOUT_S)
                return await stream.read(sink)
            finally:
                if not stream.done:  # our client went away (or the coordinator did): stop the generation
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await up.reset()

    def ring_depth(self, plan: Plan) -> int:
        """Chunks worth keeping in flight on this ring: one traversal over its slowest stage.

        A chunk occupies one stage at a time, so a ring whose traversal is T with a slowest stage
        of S can usefully hold about T / S chunks (more only queue). Both come from the plan's
        predictions (measured RTTs and ms per layer), fixed for the epoch so a generation's chunk
        schedule, hence its output, does not depend on timing; the receipt records the depth, and
        ``shard-swarm run --depth`` reproduces it on one box."""
        slowest = max([*self._stage_ms(plan), 0.05])
        return max(1, min(MAX_DEPTH, math.ceil(plan.predicted_traversal_ms / slowest)))

    def _stage_ms(self, plan: Plan) -> list[float]:
        """Each stage's predicted ms for a one-token chunk (its layers x its advertised ms per layer)."""
        view = self.view.service.membership.view()
        ms = self.models.ms_per_layer
        return [(b - a) * (view[p].layer_us / 1000 if p in view else ms) for p, (a, b) in plan.blocks.items()]

    def ring_times(self, plan: Plan) -> RingTimes:
        """The ring's costs the drafting policy weighs (drafting.py), from the plan's predictions."""
        return RingTimes.of(plan.predicted_traversal_ms, plan.predicted_compute_ms, self._stage_ms(plan))

    async def _prompt(self, req: Gen) -> list[int]:
        """The prompt's token ids: ``req.ids``, or its text tokenized here (then ``ids`` are the
        tokens a lost coordinator had committed, resumed after the text's)."""
        if req.text is None:
            return list(req.ids)
        tok = self.models.tokenizer
        if tok is None:
            raise UsageError("this coordinator has no tokenizer: send prompt token ids")
        text = req.text
        chat = req.chat and tok.chat_template is not None
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        special = not chat  # plain text gets the BOS its tokenizer asks for; a chat template writes its own
        if len(text) > 2048:  # ~1 ms per KB: a long prompt is tokenized off the trio loop
            prompt = await self.models.compute.run(lambda: tok.encode(text, add_special_tokens=special), limited=False)
        else:
            prompt = tok.encode(text, add_special_tokens=special)
        return prompt + list(req.ids)

    async def _generate(self, ep: Epoch, req: Gen, sink: GenSink) -> dict[str, Any]:
        coord = ep.coordinator
        assert coord is not None
        tok = self.models.tokenizer
        prompt = await self._prompt(req)
        check_context(len(prompt), req.max_new_tokens, self.models.context_tokens)
        params = sampling_of(req)
        depth = req.depth if req.depth is not None else self.ring_depth(ep.plan)
        drafts = self.models.drafts  # what this coordinator drafts with (drafting.py)
        choice = drafts.choose(req.draft or "", times=self.ring_times(ep.plan), depth=depth, draft_k=req.draft_k,
                               max_len=len(prompt) + req.max_new_tokens + 16, epoch=ep.plan.epoch)  # fmt: skip
        # token ids, a notice, or a long prefill's progress
        send, recv = trio.open_memory_channel[list[int] | str | tuple[int, int]](math.inf)
        all_ids: list[int] = []

        async def stream_out() -> None:
            # incremental detokenization: decode only a short window (the tokens since the last
            # emitted piece, plus the ones before it for context), never the whole output again
            prefix = read = 0
            async for ids in recv:
                if isinstance(ids, str):
                    await sink.notice(ids)
                    continue
                if isinstance(ids, tuple):
                    await sink.progress(*ids)
                    continue
                all_ids.extend(ids)
                piece = ""
                if tok is not None:
                    before = tok.decode(all_ids[prefix:read])
                    text = tok.decode(all_ids[prefix:])
                    if len(text) > len(before) and not text.endswith("\ufffd"):  # hold back half a character
                        piece = text[len(before):]
                        prefix, read = read, len(all_ids)
                await sink.tokens(ids, piece)

        t0 = time.time()
        replans: list[dict[str, Any]] = []
        last_token = [time.time()]

        def on_tokens(ids: Sequence[int]) -> None:
            now = time.time()
            if replans and "pause_s" not in replans[-1]:
                replans[-1]["pause_s"] = round(now - replans[-1]["last_token_unix"], 3)
                replans[-1]["resume_s"] = round(now - replans[-1]["ring_ready_unix"], 3)  # replay + first step
            last_token[0] = now
            send.send_nowait(list(ids))

        next_progress = [time.time() + PROGRESS_EVERY_S]

        def on_progress(done: int, total: int) -> None:  # a long prefill: news every PROGRESS_EVERY_S
            if time.time() >= next_progress[0] and done < total:
                next_progress[0] = time.time() + PROGRESS_EVERY_S
                send.send_nowait((done, total))

        def before_decode(others: int) -> None:  # a shared ring: a default prompt lookup stands down
            nonlocal choice
            shared = choice.shared(others)
            if shared is not None:
                choice = shared
                run.decoder.stop_drafting()

        try:
            run = coord.new_run(prompt, params=params, max_new_tokens=req.max_new_tokens, drafter=choice.drafter,
                                policy=choice.policy, on_tokens=on_tokens, on_progress=on_progress,
                                draft_limiter=drafts.limiter, before_decode=before_decode)  # fmt: skip
        except BaseException:
            choice.close()
            raise
        moved: CoordinatorMoved | None = None
        handed_over: dict[str, Any] = {}
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream_out)
                try:
                    await self.admission.enter(send.send_nowait)  # a slot of the ring's KV memory (capacity.py)
                    try:
                        ep = await self.resumer.drive(ep, run, replans, last_token, send.send_nowait)
                    except CoordinatorMoved as exc:
                        moved = exc
                        handed_over = await self._hand_over(exc, req, prompt, run.decoder.output_ids, depth, on_tokens,
                                                            send.send_nowait)  # fmt: skip
                    finally:
                        self.admission.leave()
                finally:
                    send.close()
        except BaseExceptionGroup as eg:
            raise unwrap(eg) from None
        finally:
            choice.close()  # the draft's KV cache for this generation
        if moved is not None:
            return _handed_over_receipt(handed_over, prompt, moved, replans, t0)
        gen = run.result()
        receipt = self.reporter.receipt(ep, gen, params, started=t0, replans=replans)
        self.reporter.recent.append((gen.tokens_per_s, gen.tokens_per_traversal))
        # a ring shared with others says nothing about its traversal alone (auto's figure)
        alone = not replans and not choice.shared_with
        drafts.learn(choice, run.decoder, gen.traversal_ms if alone else None, ep.plan.epoch)
        receipt["draft"] = choice.receipt(run.decoder)
        return receipt


    async def _hand_over(
        self, moved: CoordinatorMoved, req: Gen, prompt: list[int], committed: list[int], depth: int,
        on_tokens: Callable[[Sequence[int]], None], notify: Callable[[str], None],
    ) -> dict[str, Any]:  # fmt: skip
        """The run's next ring is coordinated elsewhere (resume.py): ask that coordinator for the
        rest, from the prompt plus the tokens committed here, with the same sampling and schedule
        (position-keyed sampling makes the rest the same tokens); its tokens stream on to our
        client as if they were ours. Its receipt."""
        done = list(committed)
        note = (f"the swarm now serves epoch {moved.epoch.plan.epoch}, coordinated by {moved.coordinator}: "
                f"handing the run over after {len(done)} tokens")  # fmt: skip
        log.info("%s", note)
        notify(note)
        rest = dataclasses.replace(req, ids=(*prompt, *done), text=None, chat=False, depth=depth,
                                   max_new_tokens=req.max_new_tokens - len(done), wait_s=HAND_OVER_WAIT_S)  # fmt: skip

        class Relay:
            async def tokens(self, ids: list[int], text: str) -> None:
                on_tokens(ids)

            async def notice(self, text: str) -> None:
                notify(text)

            async def progress(self, done: int, total: int) -> None:
                return None

        return await self._relay(moved.coordinator, rest, Relay())


def check_context(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """ContextTooLong unless a prompt of ``prompt_tokens`` plus ``max_new_tokens`` fits ``context``."""
    if prompt_tokens + max_new_tokens > context:
        raise ContextTooLong(
            f"the prompt is {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
            f"{prompt_tokens + max_new_tokens} tokens, over this swarm's context of {context}; "
            "shorten the prompt or ask for fewer tokens"
        )


def _handed_over_receipt(
    rest: dict[str, Any], prompt: list[int], moved: CoordinatorMoved, replans: list[dict[str, Any]], started: float
) -> dict[str, Any]:
    """The receipt of a run finished by another coordinator: its receipt, over the whole run
    (stitched as a client stitches a resumed run's, genstream.stitch_receipt)."""
    n = len(rest["prompt_token_ids"]) - len(prompt)  # tokens committed here before the hand-over
    old = moved.epoch
    here = [*replans, {
        "reason": str(moved)[:300], "cause": old.cause, "moved_to": moved.coordinator,
        "detected_unix": round(moved.failed_at, 3), "to_epoch": old.plan.epoch, "resumed_at_token": n,
        "compiled": moved.ran,
    }]  # fmt: skip
    return {
        **stitch_receipt(rest, n),
        "started_unix": started,
        "replans": [*here, *rest.get("replans", [])],
        # the rings here count too (the new coordinator's note covers only the rings it drove)
        "replay_note": rest.get("replay_note") or replay_note(*(r.get("compiled") or {} for r in here)),
    }


async def _until_hung_up(fs: Stream, work: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``work`` until it returns, or until the client ends its stream (it sends nothing
    more: any end of it means it hung up), which stops the generation (PeerLost)."""
    result: list[Any] = []
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                with contextlib.suppress(SwarmError):
                    await fs.receive_message(timeout=math.inf)
                log.info("the client went away: stopping its generation")
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            result.append(await work())
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise unwrap(eg) from None
    if not result:
        raise PeerLost("the client hung up")
    return result[0]
