"""The generation service: requests in, tokens and a receipt out, in-process or on ``gen/1``.

A request is one :class:`~swarm.proto.control.Gen` (prompt ids, or text that the coordinator
tokenizes, with or without the chat template), already checked against its bounds where it was
made or decoded. :func:`generate` serves it on this node, whatever the caller: the coordinator
runs it and streams its tokens to a :class:`GenSink` as they commit, and returns the run
receipt; a peer that is not the coordinator relays it there over ``/shard-swarm/gen/1``, so users
can point their tools at their own machine. The API server of this node calls :func:`generate`
directly; :func:`serve_gen` is the same service for a client on the network (``shard-swarm
generate``, the demo, a relaying peer): a ``gen`` or ``status`` request in, ``tokens`` and
``notice`` frames and one ``done`` (the receipt) or ``status_reply`` out. Anything that cannot be
served is answered with a typed ``fail`` (control.fail_of), never by silence: every wait here has
a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from swarm import __version__
from swarm.errors import (
    FaultyPeer,
    PeerError,
    PeerLost,
    PlanningError,
    ProtocolError,
    SwarmError,
    UsageError,
)
from swarm.model.drafters import NgramDrafter
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import DraftSource, KPolicy
from swarm.net.streams import FramedStream
from swarm.node.coordinator import RingGeneration, RingRun
from swarm.node.errors_util import unwrap
from swarm.proto import control as ctl
from swarm.proto.control import MAX_DEPTH, Gen
from swarm.proto.limits import PROTO_GEN
from swarm.proto.messages import parse_message

if TYPE_CHECKING:
    from swarm.node.runtime import Node

log = logging.getLogger("swarm.node.service")

REQUEST_TIMEOUT_S = 20.0
RECOVERY_TIMEOUT_S = 120.0  # a re-plan may include loading a block
NOTICE_EVERY_S = 2.0  # while a run waits for a re-plan, its client hears this often that it does
PROBLEM_GRACE_S = 3.0  # how long the planner may call the swarm too small before a run gives up


class GenSink(Protocol):
    """Where a generation's news goes as it happens (the receipt is :func:`generate`'s value)."""

    async def tokens(self, ids: list[int], text: str) -> None: ...

    async def notice(self, text: str) -> None: ...


class _StreamSink:
    """A client on a gen stream: tokens and notices as frames."""

    def __init__(self, fs: FramedStream) -> None:
        self.fs = fs

    async def tokens(self, ids: list[int], text: str) -> None:
        await self.fs.send(ctl.Tokens(tuple(ids), text).to_frame())

    async def notice(self, text: str) -> None:
        await self.fs.send(ctl.Notice(text[:1000]).to_frame())


async def serve_gen(node: Node, peer: str, fs: FramedStream) -> None:
    """``/shard-swarm/gen/1``: one ``gen`` or ``status`` request from ``peer``."""
    frame = await fs.receive(timeout=REQUEST_TIMEOUT_S)
    try:
        msg = parse_message(frame)
        if not isinstance(msg, Gen | ctl.Status):
            raise ProtocolError(f"expected a gen or status request, got {msg!r}")
        node.gen_roles.check(peer, msg)
        if isinstance(msg, ctl.Status):
            await fs.send(ctl.StatusReply(await request_status(node, msg)).to_frame())
            return
        receipt = await _until_hung_up(fs, lambda: generate(node, msg, _StreamSink(fs)))
        await fs.send(ctl.Done(receipt).to_frame())
    except SwarmError as exc:
        log.info("request from %s failed: %s", peer, exc)
        await fs.send(ctl.fail_of(exc).to_frame())


async def _until_hung_up(fs: FramedStream, work: Callable[[], Any]) -> Any:
    """Run ``work`` until it returns, or until the client ends its stream (it sends nothing
    more: any end of it means it hung up), which stops the generation (PeerLost)."""
    result: list[Any] = []
    try:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                with contextlib.suppress(SwarmError):
                    await fs.receive(timeout=math.inf)
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


async def request_status(node: Node, req: ctl.Status) -> dict[str, Any]:
    """This node's status, or (``req.coordinator``) the serving coordinator's, relayed."""
    ep = node.epoch
    if req.coordinator and ep is not None and not ep.done.is_set() and ep.plan.coordinator != node.peer_id:
        assert node.host is not None
        async with node.host.open_stream(ep.plan.coordinator, PROTO_GEN, timeout=REQUEST_TIMEOUT_S) as up:
            await up.send(ctl.Status(coordinator=True, loop_window_s=req.loop_window_s).to_frame())
            reply = parse_message(await up.receive(timeout=REQUEST_TIMEOUT_S))
        return dict(ctl.expect(reply, ctl.StatusReply, ep.plan.coordinator, "status").status)
    return status(node, loop_window_s=req.loop_window_s)


async def generate(node: Node, req: Gen, sink: GenSink) -> dict[str, Any]:
    """Serve ``req`` from this node: run it here if we coordinate the serving ring, else relay it
    to the coordinator; its tokens go to ``sink``, its receipt is returned. Cancelling the call
    stops the generation (on every stage, or at the coordinator we relay to)."""
    ep = await _serving_epoch(node, req.wait_s)
    if ep.plan.coordinator != node.peer_id:
        return await _relay(node, ep.plan.coordinator, req, sink)
    return await _generate(node, ep, req, sink)


async def _serving_epoch(node: Node, wait_s: float) -> Any:
    deadline = trio.current_time() + wait_s
    while True:
        ep = node.epoch
        if ep is not None and not ep.done.is_set() and (ep.plan.coordinator != node.peer_id or ep.serving.is_set()):
            return ep
        if trio.current_time() >= deadline:
            problem = node.planning_problem() if node.service is not None else None
            if problem is not None:
                raise PlanningError(f"the swarm cannot serve: {problem}; it keeps waiting for peers")
            state = "no plan yet" if ep is None else f"epoch {ep.plan.epoch} not serving"
            raise PeerError(f"the swarm is not ready ({state}); retry in a few seconds")
        await trio.sleep(0.1)


async def _relay(node: Node, coordinator: str, req: Gen, sink: GenSink) -> dict[str, Any]:
    """Pass ``req`` to the coordinator and its news back to ``sink``; its receipt."""
    assert node.host is not None
    async with node.host.open_stream(coordinator, PROTO_GEN, timeout=REQUEST_TIMEOUT_S) as up:
        finished = False
        try:
            await up.send(req.to_frame())
            while True:
                reply = parse_message(await up.receive(timeout=node.settings.chunk_timeout + 5))
                if isinstance(reply, ctl.Tokens):
                    await sink.tokens(list(reply.ids), reply.text)
                elif isinstance(reply, ctl.Notice):
                    await sink.notice(reply.text)
                else:
                    finished = True
                    if isinstance(reply, ctl.Fail):
                        raise reply.error()  # the coordinator's words, as they were
                    return dict(ctl.expect(reply, ctl.Done, coordinator, "gen").receipt)
        finally:
            if not finished:  # our client went away (or the coordinator did): stop the generation
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await up.reset()


def sampling_of(req: Gen) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed or 0)


def ring_depth(node: Node, plan: Any) -> int:
    """Chunks worth keeping in flight on this ring: one traversal over its slowest stage.

    A chunk occupies one stage at a time, so a ring whose traversal is T with a slowest stage of
    S can usefully hold about T / S chunks (more only queue). Both come from the plan's
    predictions (measured RTTs and ms per layer), fixed for the epoch so a generation's chunk
    schedule, hence its output, does not depend on timing; the receipt records the depth, and
    ``shard-swarm run --depth`` reproduces it on one box."""
    view = node.service.membership.view() if node.service is not None else {}
    stage_ms = [
        (b - a) * (view[p].layer_us / 1000 if p in view else node.ms_per_layer) for p, (a, b) in plan.blocks.items()
    ]
    slowest = max([*stage_ms, 0.05])
    return max(1, min(MAX_DEPTH, math.ceil(plan.predicted_traversal_ms / slowest)))


def make_drafter(name: str, *, depth: int, draft_k: int | None) -> tuple[DraftSource | None, KPolicy | None]:
    """The drafter and K/depth policy for a request; ``shard-swarm run`` builds the same ones
    from the same flags (prompt lookup costs nothing next to a target pass: draft_cost 0)."""
    if name == "none":
        return None, None
    if name == "ngram":
        return NgramDrafter(), KPolicy(max_depth=depth, fixed_k=draft_k, draft_cost=0.0)
    raise UsageError(f"unknown draft {name!r}: choose ngram or none")


async def _prompt(node: Node, req: Gen) -> list[int]:
    """The prompt's token ids: ``req.ids``, or its text tokenized here (then ``ids`` are the
    tokens a lost coordinator had committed, resumed after the text's)."""
    if req.text is None:
        return list(req.ids)
    tok = node.tokenizer
    if tok is None:
        raise UsageError("this coordinator has no tokenizer: send prompt token ids")
    text = req.text
    if req.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    if len(text) > 2048:  # ~1 ms per KB: a long prompt is tokenized off the trio loop
        prompt = await trio.to_thread.run_sync(lambda: tok.encode(text, add_special_tokens=False))
    else:
        prompt = tok.encode(text, add_special_tokens=False)
    return prompt + list(req.ids)


async def _generate(node: Node, ep: Any, req: Gen, sink: GenSink) -> dict[str, Any]:
    coord = ep.coordinator
    tok = node.tokenizer
    prompt = await _prompt(node, req)
    params = sampling_of(req)
    draft_name = req.draft or node.settings.draft
    depth = req.depth if req.depth is not None else ring_depth(node, ep.plan)
    drafter, policy = make_drafter(draft_name, depth=depth, draft_k=req.draft_k)
    send, recv = trio.open_memory_channel[list[int] | str](math.inf)  # token ids, or a notice
    all_ids: list[int] = []

    async def stream_out() -> None:
        # incremental detokenization: decode only a short window (the tokens since the last
        # emitted piece, plus the ones before it for context), never the whole output again
        prefix = read = 0
        async for ids in recv:
            if isinstance(ids, str):
                await sink.notice(ids)
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

    def on_tokens(ids: Sequence[int]) -> None:
        now = time.time()
        if replans and "pause_s" not in replans[-1]:
            replans[-1]["pause_s"] = round(now - replans[-1]["last_token_unix"], 3)
            replans[-1]["resume_s"] = round(now - replans[-1]["ring_ready_unix"], 3)  # replay + first step
        last_token[0] = now
        send.send_nowait(list(ids))

    last_token = [time.time()]
    run = coord.new_run(prompt, params=params, max_new_tokens=req.max_new_tokens, drafter=drafter, policy=policy,
                        on_tokens=on_tokens)  # fmt: skip
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_out)
            try:
                await node.admission.enter(send.send_nowait)  # a slot of the ring's KV memory (capacity.py)
                try:
                    ep = await _drive_with_recovery(node, ep, run, replans, last_token, send.send_nowait)
                finally:
                    node.admission.leave()
            finally:
                send.close()
    except BaseExceptionGroup as eg:
        raise unwrap(eg) from None
    gen = run.gen
    receipt = build_receipt(node, ep, gen, params, started=t0)
    node.recent.append((gen.tokens_per_s, gen.tokens_per_traversal))
    receipt["replans"] = replans
    receipt["draft"] = {"name": draft_name, "max_depth": depth if drafter is not None else 1, "draft_k": req.draft_k}
    return receipt


async def _drive_with_recovery(
    node: Node, ep: Any, run: RingRun, replans: list[dict[str, Any]], last_token: list[float],
    notify: Callable[[str], None] = lambda text: None,
) -> Any:
    """Drive ``run`` to the end, moving it to the next epoch's ring whenever its ring fails.

    The coordinator keeps the run (decoder, committed tokens, the log of fed chunks); the swarm
    re-plans around the lost peer (the leader's job, see runtime.py); the run then resumes on the
    new ring by replaying its fed chunks (coordinator.drive), so no token is lost or changed.
    ``notify`` tells the client, in one line, that the run paused and why, every NOTICE_EVERY_S
    while it waits (so a client, or a relaying peer, never mistakes the pause for silence), and
    when it resumes.
    """
    while True:
        try:
            await ep.coordinator.drive(run)
            return ep
        except PeerError as exc:  # the ring failed (lost, timed out, an error from a stage)
            failed_at = time.time()
            old = ep.plan
            # Whatever broke (a lost peer, a hop gone silent, a stage's error), this ring cannot
            # carry the run: end its epoch here. A loss already ended it; a ring that stalls with
            # every peer alive (a relayed stream that died silently) ends only here, and ending
            # it nudges the leader to re-plan (runtime.py), so the run never waits on a ring
            # nobody else knows is broken.
            node._end_epoch(f"a generation on epoch {old.epoch} failed: {str(exc)[:200]}", only=ep)
            if isinstance(exc, FaultyPeer):
                # a peer that sends NaN or malformed activations is not waited for: it is dropped
                await node.report_fault(exc.peer, str(exc), old.epoch)
            node.notice(f"ring failed during a generation ({exc}); waiting for the swarm to re-plan")
            notify(f"paused after {len(run.decoder.output_ids)} tokens: {str(exc)[:200]}; the swarm is re-planning")
            ep = await _next_epoch(
                node, old.epoch, RECOVERY_TIMEOUT_S,
                on_wait=lambda waited: notify(f"still waiting for the swarm to re-plan ({waited:.0f} s)"),
            )  # fmt: skip
            if ep.plan.coordinator != node.peer_id:
                raise PeerError(
                    f"the coordinator moved to {ep.plan.coordinator} after a failure; retry the request"
                ) from None
            moved = {p: list(b) for p, b in ep.plan.blocks.items() if old.blocks.get(p) != b}
            replans.append({
                "reason": str(exc)[:300],  # what this coordinator saw
                "cause": ep.cause,  # why the leader re-planned (they differ when a hand-over races)
                "lost": sorted({*old.ring, old.coordinator} - {*ep.plan.ring, ep.plan.coordinator}),
                "detected_unix": round(failed_at, 3),
                "last_token_unix": round(last_token[0], 3),
                "ring_ready_unix": round(time.time(), 3),
                "from_epoch": old.epoch,
                "to_epoch": ep.plan.epoch,
                "layers_moved": ep.plan.layers_moved,
                "blocks_changed": moved,
                "replayed_chunks": len(run.fed_log),
                "resumed_at_token": len(run.decoder.output_ids),
            })  # fmt: skip
            resumed = (
                f"resuming on epoch {ep.plan.epoch} after {time.time() - failed_at:.1f} s "
                f"({ep.plan.layers_moved} layers moved, replaying {len(run.fed_log)} chunks)"
            )
            node.notice(resumed)
            notify(resumed)


async def _next_epoch(
    node: Node, after: int, timeout: float, on_wait: Callable[[float], None] = lambda waited: None
) -> Any:
    """The next serving epoch after ``after``; PeerError when none comes within ``timeout``, or
    sooner when the planner says the live members cannot hold the model (its words: how many GB
    are missing) for longer than PROBLEM_GRACE_S: the client learns why and may retry later."""
    problem_since: float | None = None
    start = trio.current_time()
    next_check = start + 1.0
    next_notice = start + NOTICE_EVERY_S
    with trio.move_on_after(timeout):
        while True:
            ep = node.epoch
            if ep is not None and ep.plan.epoch > after and not ep.done.is_set() and (
                ep.serving.is_set() or ep.plan.coordinator != node.peer_id
            ):
                return ep
            now = trio.current_time()
            if now >= next_notice:
                next_notice = now + NOTICE_EVERY_S
                on_wait(now - start)
            if now >= next_check:  # planning costs CPU: ask once a second
                next_check = now + 1.0
                problem = node.planning_problem()
                if problem is None:
                    problem_since = None
                elif problem_since is None:
                    problem_since = now
                elif now - problem_since > PROBLEM_GRACE_S:
                    raise PlanningError(f"the swarm cannot serve: {problem}; it keeps waiting for peers")
            await trio.sleep(0.05)
    raise PeerError(f"the swarm did not recover within {timeout:.0f} s (no new plan); see the nodes' logs")


def build_receipt(node: Node, ep: Any, gen: RingGeneration, params: SamplingParams, *, started: float) -> dict[str, Any]:
    plan = ep.plan
    view = node.service.membership.view() if node.service is not None else {}
    pf = node.peers_file()
    peers = []
    for pid in sorted({plan.coordinator, *plan.ring, *plan.standbys}):
        adv = view.get(pid)
        peers.append({
            "id": pid,
            "addresses": list(adv.addrs) if adv else [],
            "device": f"{adv.device_kind}:{adv.device_name}" if adv else "",
            "memory_bytes": adv.memory_bytes if adv else 0,
            "ms_per_layer": adv.layer_us / 1000 if adv else None,
            "block": list(plan.blocks[pid]) if pid in plan.blocks else None,
            "role": "coordinator" if pid == plan.coordinator else ("stage" if pid in plan.blocks else "standby"),
        })  # fmt: skip
    tms = gen.traversal_ms
    return {
        "version": __version__,
        "model": {"name": node.settings.model_dir.name, "config_sha256": node.ckpt.config_sha256},
        "quant": node.settings.quant,
        "peers": peers,
        "coordinator": plan.coordinator,
        "ring": list(plan.ring),
        "epoch": plan.epoch,
        "rtt_ms": pf.get("rtt_ms", {}),
        "prompt_token_ids": gen.prompt_token_ids,
        "output_token_ids": gen.output_token_ids,
        "output_sha256": gen.output_sha256,
        "finish_reason": gen.finish_reason,
        "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "seed": params.seed},
        "tokens_per_s": gen.tokens_per_s,
        "decode_tokens_per_s": gen.decode_tokens_per_s,
        "traversal_ms": statistics.median(tms) if tms else None,
        "accepted_per_traversal": gen.tokens_per_traversal,
        "accepted_per_round": gen.accepted_per_round,
        # LM head calls shared with other sessions: fp32 greedy tokens equal running alone; in bf16 a
        # near-tie can flip (coordinator.py); stages compute each session's rows alone (model/batched.py)
        "shared_head_calls": gen.shared_head_calls,
        "chunks": len(gen.chunks),
        "predicted_traversal_ms": plan.predicted_traversal_ms,
        "hops": _hops(ep),
        "replans": list(node.replans),
        "started_unix": started,
    }


def _hops(ep: Any) -> list[dict[str, str]]:
    """Each hop of the ring with how it travels (the leader collected it at set-up)."""
    from swarm.node.epoch import hops

    return [{"from": a, "to": b, "path": ep.hop_labels.get(i, "?")} for i, (a, b) in enumerate(hops(ep.plan))]


def _recent(node: Node) -> dict[str, Any]:
    """Medians over the last generations this node coordinated."""
    if not node.recent:
        return {}
    tps = [t for t, _ in node.recent]
    acc = [a for _, a in node.recent if a is not None]
    return {"tokens_per_s": statistics.median(tps), "accepted_per_traversal": statistics.median(acc) if acc else None,
            "generations": len(node.recent)}


def _peer_info(node: Node, plan: Any) -> dict[str, Any]:
    """What this node sees of every member: device, memory its block uses, heartbeat age, path."""
    if node.service is None:
        return {}
    view = node.service.membership.view()
    detector = node.service.liveness.detector
    now = trio.current_time()
    out: dict[str, Any] = {}
    for peer, adv in view.items():
        heard = detector.last_heard(peer)
        block = plan.blocks.get(peer) if plan is not None else None
        used = (block[1] - block[0]) * node.spec.bytes_per_layer if block else 0
        if plan is not None and plan.coordinator == peer:
            used += node.spec.coordinator_bytes
        out[peer] = {
            "device": f"{adv.device_kind}:{adv.device_name}",
            "memory_used_bytes": used,
            "heartbeat_age_s": None if peer == node.peer_id or heard is None else round(now - heard, 2),
            "path": "self" if peer == node.peer_id else _path(node, peer),
        }
    return out


def _path(node: Node, peer: str) -> str:
    """How we reach ``peer``: direct, hole-punched, relayed via <relay> (net/ knows)."""
    return node.host.path_label(peer) if node.host is not None else "?"


def status(node: Node, *, loop_window_s: int = 60) -> dict[str, Any]:
    ep = node.epoch
    plan = ep.plan if ep is not None and not ep.done.is_set() else None
    worker = ep.worker if plan is not None and ep is not None else None
    return {
        "peer_id": node.peer_id,
        "members": node.members() if node.service is not None else [],
        "leader": node.leader() if node.service is not None else None,
        "epoch": plan.epoch if plan else None,
        "serving": bool(ep is not None and ep.serving.is_set() and not ep.done.is_set()),
        "plan": {"coordinator": plan.coordinator, "ring": list(plan.ring),
                 "blocks": {p: list(b) for p, b in plan.blocks.items()}, "standbys": list(plan.standbys)}
        if plan else None,
        "peers_file": node.peers_file() if node.service is not None else None,
        "ms_per_layer": node.ms_per_layer,
        "hop_paths": {str(k): v for k, v in node.hop_paths.items()},
        "hops": _hops(ep) if plan else [],
        "peer_info": _peer_info(node, plan),
        "recent": _recent(node),
        "replans": list(node.replans),
        "loop": node.loopwatch.summary(loop_window_s),  # how long the trio loop was held (loopwatch.py)
        "stage": dataclasses.asdict(worker.stats) if worker is not None else None,  # this epoch's batching
        "capacity": {"sessions": node.admission.capacity, "active": node.admission.active,
                     "stage_sessions": worker.max_sessions if worker is not None else None},  # fmt: skip
    }
