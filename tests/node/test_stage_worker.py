"""One stage worker (node/ring/stage_worker.py) between two in-process links, on a tiny model:
what it sends downstream for a good chunk, for bad activations (reported downstream, the
upstream named to the leader once, and the worker serves on), for chunks it cannot place, and
for the control frames that follow a session (rollback, session end). A whole ring is tested in
test_ring_mem.py; real peers in test_ring_processes.py and tests/security/test_frames.py."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from swarm.model.generate import LocalModel
from swarm.model.stage import Stage
from swarm.node.compute.runtime import Compute
from swarm.node.ring.codec import hidden_chunk, hidden_result, read_hidden
from swarm.node.ring.links import LocalLink
from swarm.node.ring.stage_worker import StageWorker
from swarm.proto.messages import Chunk, Error, Message, Result, Rollback, SessionEnd, parse_message
from swarm.testing.checkpoints import TinySpec, write_checkpoint

EPOCH = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=4), seed=5)


def _stages(ckpt: Path) -> list[Stage]:
    return LocalModel.load(ckpt, stages=[(0, 2), (2, 4)], dtype=torch.float32).stages


class _Harness:
    def __init__(self, worker: StageWorker, inbound: LocalLink, outbound: LocalLink) -> None:
        self.worker, self.inbound, self.outbound = worker, inbound, outbound
        self.bad: list[tuple[str, str]] = []

    async def send(self, msg: Message) -> None:
        await self.inbound.send(msg.to_frame(), timeout=5)

    async def next(self) -> Message:
        return parse_message(await self.outbound.receive(timeout=30))


@asynccontextmanager
async def _serving(stage: Stage, *, is_tail: bool = False, max_sessions: int = 64, threads: bool = False,
                   **worker: Any) -> AsyncIterator[_Harness]:  # fmt: skip
    inbound, outbound = LocalLink("up->stage"), LocalLink("stage->down")
    h = _Harness(None, inbound, outbound)  # type: ignore[arg-type]
    h.worker = StageWorker(stage, epoch=EPOCH, upstream="peer-up", is_tail=is_tail, max_sessions=max_sessions,
                           on_bad_input=lambda peer, why: h.bad.append((peer, why)), compute=Compute(threads=threads),
                           **worker)  # fmt: skip
    async with trio.open_nursery() as nursery:
        nursery.start_soon(h.worker.serve, inbound, outbound)
        yield h
        await inbound.close()  # the upstream goes: serve returns


def _hidden(stage: Stage, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, stage.args.dim, generator=torch.Generator().manual_seed(seed))


async def test_a_chunk_goes_downstream_computed_and_the_tail_answers_with_a_result(ckpt: Path) -> None:
    stages, ref = _stages(ckpt), _stages(ckpt)
    h = _hidden(stages[0], 3)
    ref[0].open_session(1, 64)
    want = ref[0].forward(1, h)
    async with _serving(stages[0]) as s:
        await s.send(hidden_chunk(1, 7, 0, "prefill", h, EPOCH))
        out = await s.next()
    assert isinstance(out, Chunk) and (out.session, out.chunk_id, out.pos, out.mode, out.epoch) == (1, 7, 0, "prefill", EPOCH)
    assert torch.equal(read_hidden(out, dim=stages[0].args.dim, expect=torch.float32, peer="t"), want)
    async with _serving(stages[1], is_tail=True) as s:
        await s.send(out)
        res = await s.next()
    assert isinstance(res, Result) and res.kind == "hidden" and (res.session, res.chunk_id) == (1, 7)
    assert s.worker.stats.chunks == 1 and s.worker.stats.tokens == 3


async def test_bad_activations_are_reported_downstream_and_named_to_the_leader_once(ckpt: Path) -> None:
    stage = _stages(ckpt)[0]
    d = stage.args.dim
    nan = torch.full((1, d), float("nan"))
    async with _serving(stage) as s:
        await s.send(hidden_chunk(1, 1, 0, "prefill", nan, EPOCH))
        await s.send(hidden_chunk(2, 1, 0, "prefill", torch.zeros(1, d + 1), EPOCH))
        await s.send(hidden_chunk(3, 1, 0, "prefill", _hidden(stage, 1), EPOCH - 1))  # a stale epoch
        errors = [await s.next() for _ in range(3)]
        await s.send(hidden_chunk(4, 1, 0, "prefill", _hidden(stage, 2), EPOCH))  # still serving
        good = await s.next()
    assert [(e.session, e.code) for e in errors if isinstance(e, Error)] == [(1, "bad_input"), (2, "bad_input"), (3, "bad_input")]
    texts = [e.message for e in errors if isinstance(e, Error)]
    assert all("upstream=peer-up" in t for t in texts)
    assert "NaN or Inf" in texts[0] and "expected (T," in texts[1] and f"epoch {EPOCH - 1}" in texts[2]
    assert len(s.bad) == 1 and s.bad[0][0] == "peer-up", "the leader hears of the upstream once"
    assert isinstance(good, Chunk) and good.session == 4
    assert s.worker.stats.errors == 3 and 1 not in stage.sessions()


async def test_a_chunk_it_cannot_place_is_refused_without_blaming_the_upstream(ckpt: Path) -> None:
    stage = _stages(ckpt)[0]
    async with _serving(stage, max_sessions=1) as s:
        await s.send(hidden_chunk(1, 1, 5, "decode", _hidden(stage, 1), EPOCH))  # unknown session, not at 0
        await s.send(hidden_chunk(2, 1, 0, "prefill", _hidden(stage, 2), EPOCH))
        replies = [await s.next() for _ in range(2)]
        await s.send(hidden_chunk(3, 1, 0, "prefill", _hidden(stage, 1), EPOCH))  # one session open already
        await s.send(hidden_chunk(2, 2, 4, "decode", _hidden(stage, 1), EPOCH))  # a gap: only 2 cached
        replies += [await s.next() for _ in range(2)]
    assert [type(r).__name__ for r in replies] == ["Error", "Chunk", "Error", "Error"]
    assert replies[1].session == 2  # type: ignore[attr-defined]
    errors = [r for r in replies if isinstance(r, Error)]
    assert [(e.session, e.code) for e in errors] == [(1, "bad_chunk"), (3, "sessions_full"), (2, "bad_chunk")]
    assert "unknown and chunk starts at 5" in errors[0].message
    assert "1 sessions open (limit max_sessions)" in errors[1].message
    assert "starts at position 4 but only 2 are cached" in errors[2].message
    assert s.bad == [], "the upstream sent sound activations: nobody is named"


async def test_a_session_queueing_over_its_window_is_refused_and_the_others_go_on(ckpt: Path) -> None:
    """An upstream that ignores the prefill window (module doc: the reader): while a forward runs,
    the chunks that would queue more of one session's tokens than the bound are refused with an
    ERROR naming the session; its chunks within the bound and another session's are computed, the
    upstream is not named to the leader, and what was refused is no longer counted."""
    stage = _stages(ckpt)[0]
    async with _serving(stage, threads=True, max_queued_tokens=8, compute_delay_s=0.3) as s:
        for i in range(5):  # 5 chunks of 4 tokens of session 1 while its first one computes
            await s.send(hidden_chunk(1, i, 4 * i, "prefill", _hidden(stage, 4, i), EPOCH))
        await s.send(hidden_chunk(2, 0, 0, "prefill", _hidden(stage, 4, 9), EPOCH))
        out = [await s.next() for _ in range(6)]
        await s.send(hidden_chunk(1, 5, 12, "prefill", _hidden(stage, 4, 5), EPOCH))  # from what it holds
        after = await s.next()
    chunks = sorted((m.session, m.chunk_id) for m in out if isinstance(m, Chunk))
    errors = [m for m in out if isinstance(m, Error)]
    assert chunks == [(1, 0), (1, 1), (1, 2), (2, 0)]
    assert [(e.session, e.chunk_id, e.code) for e in errors] == [(1, 3, "bad_frame"), (1, 4, "bad_frame")]
    assert "session 1's chunk 3 would queue 12 of its tokens at stage [0, 2), over the 8" in errors[0].message
    assert s.bad == [], "a refused flood names nobody to the leader"
    assert isinstance(after, Chunk) and (after.session, after.chunk_id) == (1, 5)


async def test_rollback_and_session_end_act_here_and_travel_on_except_from_the_tail(ckpt: Path) -> None:
    for is_tail in (False, True):
        stage = _stages(ckpt)[1 if is_tail else 0]
        async with _serving(stage, is_tail=is_tail) as s:
            await s.send(hidden_chunk(1, 1, 0, "prefill", _hidden(stage, 5), EPOCH))
            await s.next()
            await s.send(Rollback(1, 2, EPOCH))
            await s.send(hidden_chunk(1, 2, 2, "decode", _hidden(stage, 1), EPOCH))  # fits after the rollback
            forwarded = [await s.next() for _ in range(1 if is_tail else 2)]
            assert stage.session_len(1) == 3
            await s.send(SessionEnd(1))
            if not is_tail:
                forwarded.append(await s.next())
            with trio.move_on_after(1):
                while 1 in stage.sessions():
                    await trio.sleep(0.01)
        kinds = [type(m).__name__ for m in forwarded]
        assert kinds == (["Result"] if is_tail else ["Rollback", "Chunk", "SessionEnd"]), kinds
        assert 1 not in stage.sessions()


async def test_a_message_that_does_not_belong_on_the_activation_path_is_reported(ckpt: Path) -> None:
    stage = _stages(ckpt)[0]
    async with _serving(stage) as s:
        await s.send(hidden_result(9, 3, 0, _hidden(stage, 1), EPOCH))
        err = await s.next()
    assert isinstance(err, Error) and err.code == "unexpected" and "RESULT on the activation path" in err.message
    assert (err.session, err.chunk_id) == (9, 3)


async def test_a_frame_that_is_no_valid_message_is_answered_and_the_stage_goes_on(ckpt: Path) -> None:
    """The link hands the reader a BadMessage (swarm.proto.messages.expect_message): its frame's
    session and chunk id get a bad_frame ERROR, and the next chunk is computed as usual."""
    stage = _stages(ckpt)[0]
    good = hidden_chunk(6, 1, 0, "prefill", _hidden(stage, 2), EPOCH).to_frame()
    bad = dataclasses.replace(good, session=5, seq=8, meta={**good.meta, "junk": 1})
    async with _serving(stage) as s:
        await s.inbound.send(bad, timeout=5)
        await s.inbound.send(good, timeout=5)
        err, out = await s.next(), await s.next()
    assert isinstance(err, Error) and err.code == "bad_frame" and (err.session, err.chunk_id) == (5, 8)
    assert "peer up->stage" in err.message and "'junk'" in err.message
    assert isinstance(out, Chunk) and (out.session, out.chunk_id) == (6, 1)
    assert s.worker.stats.errors == 1


async def test_a_forward_out_of_memory_fails_only_the_session_that_needs_it(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compute/memory.py's injected out-of-memory for chunks of 30 tokens or more: a 40-token
    prefill fails alone (an ERROR ``out_of_memory`` naming the stage, its cache dropped, nobody
    blamed); the small session queued behind it is computed as if nothing happened, and the stage
    serves it on, and a new session after it. (A failed forward that several sessions shared is
    retried one session at a time: this test cannot make the two share one, so it does not reach
    that branch.)"""
    from swarm.node.compute import memory

    monkeypatch.setattr(memory, "INJECT_OOM_TOKENS", 30)
    stages, ref = _stages(ckpt), _stages(ckpt)
    small, big = _hidden(stages[0], 3, seed=1), _hidden(stages[0], 40, seed=2)
    ref[0].open_session(1, 64)
    want = ref[0].forward(1, small)
    async with _serving(stages[0]) as s:
        await s.send(hidden_chunk(2, 1, 0, "prefill", big, EPOCH))
        await s.send(hidden_chunk(1, 1, 0, "prefill", small, EPOCH))
        replies = {m.session: m for m in [await s.next() for _ in range(2)]}  # type: ignore[attr-defined]
        assert 2 not in stages[0].sessions() and stages[0].session_len(1) == 3
        await s.send(hidden_chunk(1, 2, 3, "decode", _hidden(stages[0], 1, seed=3), EPOCH))
        await s.send(hidden_chunk(3, 1, 0, "prefill", _hidden(stages[0], 29, seed=4), EPOCH))
        later = [await s.next() for _ in range(2)]
    err, ok = replies[2], replies[1]
    assert isinstance(err, Error) and err.code == "out_of_memory" and err.chunk_id == 1
    assert err.message.startswith("stage [0, 2): out of memory (injected: a forward over 40 tokens")
    assert isinstance(ok, Chunk) and torch.equal(read_hidden(ok, dim=stages[0].args.dim, expect=torch.float32, peer="t"), want)
    assert sorted((type(m).__name__, m.session) for m in later) == [("Chunk", 1), ("Chunk", 3)]  # type: ignore[attr-defined]
    assert s.worker.stats.errors == 1 and s.bad == []


async def test_a_lone_decode_chunk_runs_on_the_trio_thread_after_a_preempted_forward(ckpt: Path) -> None:
    """Where each forward ran (model/batched.py: InlinePolicy): the first in a worker thread (its time
    unknown), then, one session alone, on the trio thread, even right after a forward that took
    300 ms (preempted on a busy box: the median says 20 ms). Times are given, not measured."""
    stage = _stages(ckpt)[0]
    inbound, outbound = LocalLink("up->stage"), LocalLink("stage->down")
    worker = StageWorker(stage, epoch=EPOCH, upstream="peer-up", is_tail=False, compute=Compute())
    on_trio_thread: list[bool] = []
    took = iter([0.02, 0.02, 0.3, 0.02, 0.02])
    forward = worker._forward

    def timed(groups: list[list[tuple[Chunk, torch.Tensor]]]) -> tuple[list[Any], float]:
        on_trio_thread.append(threading.current_thread() is threading.main_thread())
        return forward(groups)[0], next(took)

    worker._forward = timed  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.serve, inbound, outbound)
        for pos in range(5):
            await inbound.send(hidden_chunk(1, pos + 1, pos, "decode", _hidden(stage, 1, pos), EPOCH).to_frame())
            out = parse_message(await outbound.receive(timeout=30))
            assert isinstance(out, Chunk) and out.pos == pos
        await inbound.close()
    assert on_trio_thread == [False, True, True, True, True]


async def test_a_session_whose_end_never_comes_is_freed_once_idle_and_counted(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """Issue 26: a SESSION_END lost on the way (a send that timed out) left the session's KV cache
    at this stage for the rest of the epoch. A session silent for ``idle_s`` is freed; one that
    still sends is kept, and one with a chunk waiting here is never idle."""
    stage = _stages(ckpt)[0]
    async with _serving(stage, idle_s=60.0) as s:
        for session in (1, 2, 3):
            await s.send(hidden_chunk(session, 1, 0, "prefill", _hidden(stage, 3), EPOCH))
            await s.next()
        held = s.worker.held()
        assert held["sessions"] == 3 and held["kv_bytes"] > 0 and held["tracked"] == 3
        await trio.sleep(40)
        await s.send(hidden_chunk(2, 2, 3, "decode", _hidden(stage, 1), EPOCH))  # session 2 goes on
        await s.next()
        await trio.sleep(30)  # 1 and 3 silent for 70 s, 2 for 30
        assert sorted(stage.sessions()) == [2]  # type: ignore[type-var]
        assert s.worker.stats.evicted == 2
        await trio.sleep(70)
        assert s.worker.held() == {"sessions": 0, "kv_bytes": 0, "queued": 0, "queued_tokens": 0, "tracked": 0}
        assert s.worker.stats.evicted == 3
        await s.send(hidden_chunk(4, 1, 0, "prefill", _hidden(stage, 3), EPOCH))  # the stage serves on
        assert isinstance(await s.next(), Chunk)


async def test_an_ended_workers_teardown_frees_its_own_sessions_not_a_newer_epochs(ckpt: Path) -> None:
    """A re-plan that keeps a block hands the same Stage to the next epoch's worker, which may
    open sessions (a replay) before the old worker has unwound: the old one frees only its own."""
    stage = _stages(ckpt)[0]
    async with _serving(stage) as old:
        await old.send(hidden_chunk(1, 1, 0, "prefill", _hidden(stage, 3), EPOCH))
        await old.next()
        inbound, outbound = LocalLink("up->new"), LocalLink("new->down")
        new = StageWorker(stage, epoch=EPOCH + 1, upstream="peer-up", is_tail=False, compute=Compute(threads=False),
                          max_sessions=1)  # its table is its own: the old epoch's session 1 takes no room
        async with trio.open_nursery() as nursery:
            nursery.start_soon(new.serve, inbound, outbound)
            await inbound.send(hidden_chunk(7, 1, 0, "prefill", _hidden(stage, 3), EPOCH + 1).to_frame(), timeout=5)
            await outbound.receive(timeout=30)
            assert sorted(stage.sessions()) == [1, 7]  # type: ignore[type-var]
            await old.inbound.close()  # the old epoch's worker ends
            with trio.move_on_after(5):
                while 1 in stage.sessions():
                    await trio.sleep(0.01)
            assert stage.sessions() == [7], "the old worker freed its session and left the new one's"
            await inbound.close()
    assert stage.sessions() == []


async def test_a_session_end_behind_its_waiting_chunks_frees_the_session_before_the_next_opens(ckpt: Path) -> None:
    """Issue 26: a session that ends with a chunk still queued here (a client gone mid-prefill, a
    run finished with chunks in flight) held its place until that chunk was computed, so the next
    session's first chunk, queued behind the SESSION_END, found the table full: refused, and the
    coordinator re-planned the ring (over and over on a loaded box). Now the SESSION_END drops
    the chunks it follows (computed for nobody) and frees the session at once."""
    stage = _stages(ckpt)[0]
    gate, running = threading.Event(), threading.Event()
    async with _serving(stage, max_sessions=2, threads=True) as s:
        forward = s.worker._forward

        def held_forward(batch):  # type: ignore[no-untyped-def]
            running.set()
            gate.wait(30)
            return forward(batch)

        s.worker.placing.inline = lambda **kw: False  # type: ignore[method-assign]
        for session in (1, 2):
            await s.send(hidden_chunk(session, 1, 0, "prefill", _hidden(stage, 3), EPOCH))
            await s.next()
        computed = s.worker.stats.chunks
        s.worker._forward = held_forward  # type: ignore[method-assign]
        await s.send(hidden_chunk(2, 2, 3, "decode", _hidden(stage, 1), EPOCH))  # a forward runs...
        await trio.to_thread.run_sync(running.wait, 30)
        await s.send(hidden_chunk(1, 2, 3, "decode", _hidden(stage, 1), EPOCH))  # ...while these queue
        await s.send(SessionEnd(1))
        await s.send(hidden_chunk(3, 1, 0, "prefill", _hidden(stage, 2), EPOCH))
        while s.worker.stats.max_queued < 3:
            await trio.sleep(0.01)
        gate.set()
        replies = [await s.next() for _ in range(3)]
    kinds = [(type(r).__name__, getattr(r, "session", None)) for r in replies]
    assert kinds == [("Chunk", 2), ("SessionEnd", 1), ("Chunk", 3)], kinds
    assert s.worker.stats.chunks == computed + 2, "session 1's last chunk was computed for nobody"
