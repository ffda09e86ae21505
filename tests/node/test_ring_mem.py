"""The ring's data path (coordinator + stage workers) over the in-memory network, checked
against the in-process reference: same tokens, same chunk schedule, sessions kept apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from swarm.errors import PeerError, PeerTimeout
from swarm.model.drafters import NgramDrafter
from swarm.model.driver import output_sha256
from swarm.model.generate import LocalModel, generate
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import KPolicy
from swarm.node.ring.coordinator import Coordinator, RingRun
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.ring import run_memory_ring

PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    spec = TinySpec(n_layers=6, row_gain_spread=1.0)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), spec, seed=3)


def _model(ckpt: Path, blocks: list[tuple[int, int]], dtype: torch.dtype = torch.float32) -> LocalModel:
    return LocalModel.load(ckpt, stages=blocks, dtype=dtype)


@pytest.mark.parametrize("blocks", [[(0, 6)], [(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]])
@pytest.mark.parametrize("drafted", [False, True])
async def test_ring_greedy_matches_reference(ckpt: Path, blocks: list[tuple[int, int]], drafted: bool) -> None:
    ref_model = _model(ckpt, blocks)
    policy = (lambda: KPolicy(fixed_k=3, max_depth=3)) if drafted else (lambda: None)
    drafter = (lambda: NgramDrafter()) if drafted else (lambda: None)
    ref = generate(ref_model, PROMPT, max_new_tokens=40, drafter=drafter(), policy=policy(), eos_token_ids=())

    ring_model = _model(ckpt, blocks)

    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(PROMPT, max_new_tokens=40, drafter=drafter(), policy=policy(), eos_token_ids=())

    (res,), ring = await run_memory_ring(ring_model, [job], delay=0.001)
    assert not isinstance(res, BaseException), res
    assert res.output_token_ids == ref.output_token_ids
    assert res.output_sha256 == output_sha256(ref.output_token_ids)
    assert len(res.output_token_ids) == 40
    if drafted:
        assert res.rounds > 0 and res.accepted > 0
    # every stage saw traffic, and every session was freed at the end
    assert all(w.stats.chunks > 0 for w in ring.workers)
    assert all(not w.stage.sessions() for w in ring.workers)


async def test_concurrent_sessions_do_not_mix(ckpt: Path) -> None:
    blocks = [(0, 3), (3, 6)]
    ref_model = _model(ckpt, blocks)
    prompts = [PROMPT, [1, 2, 3, 4], [200, 100, 50, 25, 12, 6]]
    refs = [generate(ref_model, p, max_new_tokens=24, eos_token_ids=()).output_token_ids for p in prompts]
    ring_model = _model(ckpt, blocks)
    def job_for(prompt: list[int]):  # type: ignore[no-untyped-def]
        return lambda c: c.generate(prompt, max_new_tokens=24, eos_token_ids=(), drafter=NgramDrafter(),
                                    policy=KPolicy(fixed_k=2, max_depth=2))

    jobs = [job_for(p) for p in prompts]
    results, _ = await run_memory_ring(ring_model, jobs, delay=0.002)
    for res, want in zip(results, refs, strict=True):
        assert not isinstance(res, BaseException), res
        assert res.output_token_ids == want


async def test_sampling_reproducible_by_seed(ckpt: Path) -> None:
    blocks = [(0, 3), (3, 6)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    ref = generate(_model(ckpt, blocks), PROMPT, params=params, max_new_tokens=24, eos_token_ids=())

    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(PROMPT, params=params, max_new_tokens=24, eos_token_ids=())

    (a, b), _ = await run_memory_ring(_model(ckpt, blocks), [job, job])
    assert not isinstance(a, BaseException) and not isinstance(b, BaseException)
    assert a.output_token_ids == b.output_token_ids == ref.output_token_ids


async def test_killed_stage_fails_generation_with_named_error(ckpt: Path) -> None:
    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(PROMPT, max_new_tokens=200, eos_token_ids=())

    async def kill_middle(ring):  # type: ignore[no-untyped-def]
        while ring.workers[1].stats.chunks < 5:
            await trio.sleep(0.001)
        ring.links[2].cut("kill")

    (res,), _ = await run_memory_ring(_model(ckpt, [(0, 2), (2, 4), (4, 6)]), [job], during=kill_middle, chunk_timeout=2.0)
    assert isinstance(res, PeerError), res


async def test_frozen_stage_times_out(ckpt: Path) -> None:
    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(PROMPT, max_new_tokens=200, eos_token_ids=())

    async def freeze(ring):  # type: ignore[no-untyped-def]
        while ring.workers[0].stats.chunks < 5:
            await trio.sleep(0.001)
        ring.links[1].cut("freeze")

    with trio.fail_after(10):
        (res,), _ = await run_memory_ring(_model(ckpt, [(0, 3), (3, 6)]), [job], during=freeze, chunk_timeout=0.5)
    assert isinstance(res, PeerTimeout), res
    assert "no result from the ring" in str(res)


async def test_nan_activation_is_refused_and_named(ckpt: Path) -> None:
    model = _model(ckpt, [(0, 3), (3, 6)])
    # a faulty first stage: its layers produce NaN
    with torch.no_grad():
        for p in model.stages[0].parameters():
            p.fill_(float("nan"))

    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(PROMPT, max_new_tokens=8, eos_token_ids=())

    (res,), ring = await run_memory_ring(model, [job], chunk_timeout=5.0)
    assert isinstance(res, PeerError) and "NaN" in str(res), res
    assert ring.workers[1].stats.errors >= 1


async def _cut_after(model: LocalModel, prompt: list[int], tokens: int, seen: list[int], kw: dict) -> RingRun:  # type: ignore[type-arg]
    """A run on a ring whose second hop is cut once ``tokens`` tokens streamed (into ``seen``): the
    run, failed, to resume on another ring."""
    runs: list[RingRun] = []

    async def first(c: Coordinator):  # type: ignore[no-untyped-def]
        runs.append(c.new_run(prompt, on_tokens=seen.extend, **kw))
        return await c.drive(runs[0])

    async def kill_when_halfway(ring):  # type: ignore[no-untyped-def]
        while len(seen) < tokens:
            await trio.sleep(0.001)
        ring.links[2].cut("kill")

    (res,), _ = await run_memory_ring(model, [first], during=kill_when_halfway, chunk_timeout=2.0, delay=0.001)
    assert isinstance(res, PeerError), res
    return runs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_resume_after_lost_stage_is_token_identical(ckpt: Path, dtype: torch.dtype) -> None:
    """A stage dies mid-generation; a new ring (same blocks, fresh caches) resumes the run by
    replaying what was fed: the output equals an uninterrupted ring run, bit for bit in bf16."""
    blocks = [(0, 2), (2, 4), (4, 6)]

    def run_kw() -> dict:  # type: ignore[type-arg]
        return dict(max_new_tokens=60, eos_token_ids=(), drafter=NgramDrafter(), policy=KPolicy(fixed_k=3, max_depth=2))

    (ref,), _ = await run_memory_ring(_model(ckpt, blocks, dtype), [lambda c: c.generate(PROMPT, **run_kw())])
    assert not isinstance(ref, BaseException), ref

    model = _model(ckpt, blocks, dtype)
    seen: list[int] = []
    run = await _cut_after(model, PROMPT, 25, seen, run_kw())
    assert 25 <= len(seen) < 60
    # a new epoch: new links and workers over the same blocks (caches start empty)
    replayed = len(run.fed_log)
    (res2,), ring = await run_memory_ring(model, [lambda c: c.drive(run)], epoch=2)
    assert not isinstance(res2, BaseException), res2
    assert res2.output_token_ids == ref.output_token_ids
    assert seen == ref.output_token_ids  # streamed: nothing lost, nothing repeated
    for w in ring.workers:  # every stage rebuilt its cache from every fed chunk, several per call
        assert w.stats.replayed == replayed > 10 and w.stats.replay_groups >= 1, w.stats
        assert w.stats.chunks - w.stats.replayed < w.stats.batches  # ... in fewer calls than chunks


async def test_a_replay_with_bad_chunks_computes_the_good_ones_and_names_the_sender(ckpt: Path) -> None:
    """Replay groups take only sound chunks: when the first stage starts sending NaN during a
    replay, the next stage computes the replay chunks before them (groups of 1, 1, 2, 4), refuses
    the rest, one by one, naming its upstream, and the run fails with that error."""
    blocks = [(0, 3), (3, 6)]
    model = _model(ckpt, blocks, torch.bfloat16)
    run_kw = dict(max_new_tokens=40, eos_token_ids=(), drafter=NgramDrafter(), policy=KPolicy(fixed_k=3, max_depth=2))
    state: dict = {}  # type: ignore[type-arg]

    seen: list[int] = []

    async def first(c: Coordinator):  # type: ignore[no-untyped-def]
        state["run"] = c.new_run(PROMPT, on_tokens=seen.extend, **run_kw)  # type: ignore[arg-type]
        return await c.drive(state["run"])

    async def kill_late(ring):  # type: ignore[no-untyped-def]
        while len(seen) < 30:
            await trio.sleep(0.001)
        ring.links[1].cut("kill")

    (res,), _ = await run_memory_ring(model, [first], during=kill_late, chunk_timeout=2.0, delay=0.001)
    assert isinstance(res, PeerError), res
    run = state["run"]
    n = len(run.fed_log)

    async def corrupt(ring):  # type: ignore[no-untyped-def]
        ring.workers[0].corrupt_after = 8  # the batch that starts with 8 chunks computed: all NaN

    (res,), ring = await run_memory_ring(model, [lambda c: c.drive(run)], epoch=2, during=corrupt)
    assert isinstance(res, PeerError) and "bad_input" in str(res), res
    up, down = ring.workers[0].stats, ring.workers[1].stats
    assert n > 16 and up.replayed >= 16, up  # the first stage replayed on (groups 1, 1, 2, 4, 8, ...)
    assert down.replayed == 8 and down.errors >= 1, down  # the 8 good ones, then refusals


async def test_ring_and_one_box_agree_in_bf16_with_chunks_in_flight(ckpt: Path) -> None:
    """bf16 numerics depend on chunk shapes: the ring and swarm.model.generate must issue the same
    chunks (poll after every result), so their outputs agree token for token."""
    blocks = [(0, 2), (2, 4), (4, 6)]
    kw = dict(max_new_tokens=60, eos_token_ids=(), prefill_chunk=4)
    ref = generate(_model(ckpt, blocks, torch.bfloat16), PROMPT, drafter=NgramDrafter(),
                   policy=KPolicy(max_depth=3), **kw)

    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(PROMPT, drafter=NgramDrafter(), policy=KPolicy(max_depth=3), **kw)

    (res,), _ = await run_memory_ring(_model(ckpt, blocks, torch.bfloat16), [job], delay=0.002)
    assert not isinstance(res, BaseException), res
    assert res.output_token_ids == ref.output_token_ids
    live = [c for c in res.chunks]  # every chunk the ring sent; the reference ran the live ones
    assert [c for c in ref.chunks if c in live] == ref.chunks


async def test_batched_sessions_of_different_lengths_join_and_leave_each_equal_to_alone(ckpt: Path) -> None:
    """Continuous batching: sessions of different lengths, one joining late and several ending
    while others go on, a long prompt prefilled in pieces between the others' decode steps; each
    session's tokens equal its run alone (fp32), and the forwards were really shared."""
    blocks = [(0, 2), (2, 4), (4, 6)]
    ref_model = _model(ckpt, blocks)
    long_prompt = [(i * 37 + 11) % 256 for i in range(200)]  # 4 prefill pieces of 64
    specs = [  # (prompt, new tokens, start after s)
        (PROMPT, 30, 0.0), ([1, 2, 3, 4], 8, 0.0), ([200, 100, 50, 25, 12, 6], 16, 0.0),
        ([9] * 20, 12, 0.0), (long_prompt, 6, 0.15), ([7, 7, 8], 10, 0.3),
    ]  # fmt: skip
    refs = [generate(ref_model, p, max_new_tokens=n, eos_token_ids=()).output_token_ids for p, n, _ in specs]

    def job_for(prompt: list[int], n: int, after: float, drafted: bool):  # type: ignore[no-untyped-def]
        async def job(c: Coordinator):  # type: ignore[no-untyped-def]
            await trio.sleep(after)
            kw = {"drafter": NgramDrafter(), "policy": KPolicy(fixed_k=2, max_depth=2)} if drafted else {}
            return await c.generate(prompt, max_new_tokens=n, eos_token_ids=(), **kw)

        return job

    jobs = [job_for(p, n, after, i % 2 == 0) for i, (p, n, after) in enumerate(specs)]
    results, ring = await run_memory_ring(_model(ckpt, blocks), jobs, delay=0.001, compute_delay_s=0.01, trace=True)
    for res, want in zip(results, refs, strict=True):
        assert not isinstance(res, BaseException), res
        assert res.output_token_ids == want
    assert sum(r.shared_head_calls for r in results if not isinstance(r, BaseException)) > 0
    for w in ring.workers:
        assert w.trace and max(len(b) for b in w.trace) >= 3, w.trace  # forwards were shared
        assert all(len({s for s, _, _ in b}) == len(b) for b in w.trace)  # one chunk per session per forward
        assert not w.stage.sessions()  # every session freed
    first = ring.workers[0].trace
    assert first is not None
    long_session = next(s for b in first for s, pos, t in b if t == 64)
    pieces = [i for i, b in enumerate(first) for s, pos, t in b if s == long_session and pos < 200]
    # one prefill piece per forward, and (above) one chunk per session per forward: a decode step
    # that arrives while the prompt is prefilled waits for one piece at most, never the whole
    # prompt. Whether one arrives then depends on where the others are in the ring (timing), so
    # it is not asserted: it failed in 1 run of ~6 in a loaded process with every piece correct.
    assert len(pieces) == 4 and len(set(pieces)) == 4


@pytest.mark.parametrize("gather", [True, False])
async def test_sessions_started_apart_come_to_share_every_forward(ckpt: Path, gather: bool) -> None:
    """Four sessions started a few ms apart: without gathering, each stage computes whatever is
    queued when the first chunk lands and the split goes round the ring; with it, stages wait and
    all four share forwards (printed: the mean batch over the later half of each stage's batches,
    before the last ones), and each session's tokens still equal its run alone (fp32)."""
    blocks = [(0, 2), (2, 4), (4, 6)]
    ref_model = _model(ckpt, blocks)
    prompts = [[5, 17, 99, 3], [1, 2, 3, 4, 5], [200, 100, 50], [9, 9, 8, 7, 6, 5]]
    refs = [generate(ref_model, p, max_new_tokens=24, eos_token_ids=()).output_token_ids for p in prompts]

    def job_for(prompt: list[int], after: float):  # type: ignore[no-untyped-def]
        async def job(c: Coordinator):  # type: ignore[no-untyped-def]
            await trio.sleep(after)
            return await c.generate(prompt, max_new_tokens=24, eos_token_ids=())

        return job

    jobs = [job_for(p, 0.004 * i) for i, p in enumerate(prompts)]
    results, ring = await run_memory_ring(
        _model(ckpt, blocks), jobs, delay=0.001, compute_delay_s=0.01, trace=True, gather=gather
    )
    for res, want in zip(results, refs, strict=True):
        assert not isinstance(res, BaseException), res
        assert res.output_token_ids == want
    for w in ring.workers:
        assert w.trace
        steady = w.trace[len(w.trace) // 2 : -2]  # all four are decoding
        mean = sum(len(b) for b in steady) / len(steady)
        print(w, "gather" if gather else "no gather", [len(b) for b in w.trace], w.stats)
        # how often all four share a forward (mean ~4 with gathering on a quiet box, < 3.5 without)
        # is a timing figure: wall-clock here, so it is printed, not asserted (a full suite on a
        # busy 2-core box read [1, 3, 4, 1, 3, 4, ...], and a clean-clone CI run never saw four
        # share one forward: sizes [3, 42, 3]); the policy's windows are asserted on
        # virtual time in tests/node/test_gathering.py
        if gather:  # it waited, and a wait let sessions share (all four at once: timing, above)
            assert w.stats.gathers > 0 and w.stats.max_batch >= 2, ([len(b) for b in w.trace], mean)
        else:  # the control: no gathering at all
            assert w.stats.gathers == 0, [len(b) for b in w.trace]


async def test_a_shared_ring_stands_down_a_default_drafter_before_decoding(ckpt: Path) -> None:
    """RingRun.before_decode hears, once, after the prefill and before any decode chunk, how many
    other generations share the ring; sessions that stop drafting there decode plainly (tokens and
    chunk schedule of a drafter-less run), a lone one keeps its drafter."""
    blocks = [(0, 3), (3, 6)]
    ref_model = _model(ckpt, blocks)
    prompts = [PROMPT, [1, 2, 3, 4, 1, 2, 3, 4], [200, 100, 50, 25, 12, 6]]
    refs = [generate(ref_model, p, max_new_tokens=16, eos_token_ids=()).output_token_ids for p in prompts]
    heard: list[list[int]] = [[] for _ in prompts]

    def job_for(i: int, after: float):  # type: ignore[no-untyped-def]
        async def job(c: Coordinator):  # type: ignore[no-untyped-def]
            await trio.sleep(after)
            def before_decode(others: int) -> None:
                heard[i].append(others)
                if others:
                    run.decoder.stop_drafting()

            run = c.new_run(prompts[i], max_new_tokens=16, eos_token_ids=(), drafter=NgramDrafter(),
                            policy=KPolicy(fixed_k=2, max_depth=3, depth_threshold=0.0),
                            before_decode=before_decode)  # fmt: skip
            return await c.drive(run)

        return job

    # two start together; the third starts once they are done (alone on the ring)
    results, _ = await run_memory_ring(_model(ckpt, blocks), [job_for(0, 0), job_for(1, 0), job_for(2, 5.0)],
                                       delay=0.002)  # fmt: skip
    for res, want in zip(results, refs, strict=True):
        assert not isinstance(res, BaseException), res
        assert res.output_token_ids == want
    assert heard == [[1], [1], [0]]
    shared, alone = [r for r in results if not isinstance(r, BaseException)][:2], results[2]
    assert not isinstance(alone, BaseException)
    for r in shared:  # plain decoding: one token per decode chunk, nothing proposed
        assert r.proposed == 0 and all(t == 1 for _, t in r.chunks[1:])
    assert alone.proposed > 0  # alone, the drafter ran


@pytest.mark.parametrize("window", [1, 3, None])
async def test_a_long_prompt_is_in_flight_a_window_of_pieces_at_a_time(ckpt: Path, window: int | None) -> None:
    """The prefill window (coordinator.py): a long prompt's pieces on the ring (sent, result not in)
    never exceed the window, and the first stage, slower than the coordinator, never queues more;
    the tokens equal one box's without a window. ``None``: a window as long as the prompt, which
    the first stage must then queue nearly whole (what the window prevents)."""
    blocks = [(0, 2), (2, 4), (4, 6)]
    prompt = [(i * 37 + 11) % 256 for i in range(90)]  # 23 pieces of 4
    kw = dict(max_new_tokens=8, eos_token_ids=(), prefill_chunk=4)
    ref = generate(_model(ckpt, blocks), prompt, prefill_window=100, **kw)
    most = 0

    async def watch(ring):  # type: ignore[no-untyped-def]
        nonlocal most
        while True:  # sent to the first stage less the tail's results so far: at least what is in flight
            most = max(most, ring.links[0].frames_sent - ring.links[-1].frames_sent)
            await trio.sleep(0.0005)

    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(prompt, prefill_window=window or 100, **kw)

    async def during(ring):  # type: ignore[no-untyped-def]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, ring)
            with trio.move_on_after(60):
                while any(w.stats.chunks < 23 for w in ring.workers):
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    (res,), ring = await run_memory_ring(_model(ckpt, blocks), [job], delay=0.001, compute_delay_s=0.005,
                                         during=during)  # fmt: skip
    assert not isinstance(res, BaseException), res
    assert res.output_token_ids == ref.output_token_ids and res.chunks[:23] == ref.chunks[:23]
    queued = ring.workers[0].stats.max_queued
    if window is None:
        assert most > 15 and queued > 15, (most, queued)
    else:
        assert 1 <= most <= window and queued <= window, (most, queued)


async def test_a_resumed_run_replays_a_window_of_tokens_at_a_time(ckpt: Path) -> None:
    """A run resumed on a new ring replays what it fed (10 prompt pieces of 4, then one-token
    decode chunks) keeping to the decoder's window of tokens in flight (2 pieces: 8 tokens), so
    the first stage never queues more than 8 messages; the output equals an uninterrupted run's."""
    blocks = [(0, 2), (2, 4), (4, 6)]
    prompt = [(i * 37 + 11) % 256 for i in range(40)]
    kw = dict(max_new_tokens=40, eos_token_ids=(), prefill_chunk=4, prefill_window=2)
    ref = generate(_model(ckpt, blocks), prompt, **kw)
    model = _model(ckpt, blocks)
    run = await _cut_after(model, prompt, 20, [], kw)
    replayed = len(run.fed_log)
    (res2,), ring = await run_memory_ring(model, [lambda c: c.drive(run)], epoch=2, delay=0.001,
                                          compute_delay_s=0.003)  # fmt: skip
    assert not isinstance(res2, BaseException), res2
    assert res2.output_token_ids == ref.output_token_ids
    first_stage = ring.workers[0].stats
    assert first_stage.replayed == replayed > 25, first_stage
    assert 1 <= first_stage.max_queued <= 8, first_stage


async def test_generations_that_end_any_way_leave_nothing_held_on_the_ring(ckpt: Path) -> None:
    """Issue 26: whatever way a generation ends (finished, its client gone mid-prefill or
    mid-decode, refused by a stage for its context), nothing of it stays at any stage (sessions,
    KV bytes, queues, gathering figures) or at the coordinator (sessions, queued results, the
    head's batching figures). Hung-up runs leave chunks in flight whose results drain after the
    session ended: they once left the head's figures of every such session behind."""
    rng = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(1, 200, (n,), generator=rng).tolist()  # noqa: E731
    done = trio.Event()
    ended = [0]
    held: list[dict[str, int]] = []

    def counted(job):  # type: ignore[no-untyped-def]
        async def run(c: Coordinator):  # type: ignore[no-untyped-def]
            try:
                return await job(c)
            finally:
                ended[0] += 1
                if ended[0] == len(jobs):
                    done.set()
        return run

    def hung_up(after: float, n: int):  # type: ignore[no-untyped-def]
        async def job(c: Coordinator):  # type: ignore[no-untyped-def]
            with trio.move_on_after(after):
                return await c.generate(prompt(n), max_new_tokens=30, eos_token_ids=())
            raise PeerTimeout("the client hung up")
        return job

    def plain(n: int):  # type: ignore[no-untyped-def]
        async def job(c: Coordinator):  # type: ignore[no-untyped-def]
            return await c.generate(prompt(n), max_new_tokens=8, eos_token_ids=())
        return job

    jobs = [counted(j) for j in [*(hung_up(0.02 * (k + 1), 120) for k in range(8)), plain(140), plain(170), plain(40)]]

    async def watch(ring):  # type: ignore[no-untyped-def]
        ring.workers[1].max_len = 150  # the middle stage refuses positions past 150: context_exceeded
        await done.wait()
        await trio.sleep(0.5)  # the last SESSION_ENDs on their way round
        held.extend([*(w.held() for w in ring.workers), ring.coordinator.held()])

    results, ring = await run_memory_ring(_model(ckpt, [(0, 2), (2, 4), (4, 6)]), jobs, during=watch, delay=0.002)
    kinds = [type(r).__name__ for r in results]
    assert kinds[-3:] == ["GenerationResult", "ContextTooLong", "GenerationResult"], kinds
    assert "PeerTimeout" in kinds, "some clients hung up before their generation finished"
    zero_stage = {"sessions": 0, "kv_bytes": 0, "queued": 0, "queued_tokens": 0, "tracked": 0}
    assert held[:3] == [zero_stage] * 3, held
    assert held[3] == {"sessions": 0, "results_queued": 0, "head_queued": 0, "head_tracked": 0}, held[3]


async def test_a_stage_whose_session_table_is_full_refuses_the_request_alone(ckpt: Path) -> None:
    """A full table at a stage (sessions ending or given up still held) fails the one request with
    RequestRefused: the ring is sound, so no re-plan (as a PeerError would make), and the other
    sessions finish. Issue 26's loaded run re-planned 56 times on such refusals."""
    async def job(c: Coordinator):  # type: ignore[no-untyped-def]
        return await c.generate(PROMPT, max_new_tokens=12, eos_token_ids=())

    async def one_seat(ring):  # type: ignore[no-untyped-def]
        ring.workers[1].max_sessions = 1

    results, _ = await run_memory_ring(_model(ckpt, [(0, 2), (2, 4), (4, 6)]), [job, job], during=one_seat, delay=0.002)
    kinds = sorted(type(r).__name__ for r in results)
    assert kinds == ["GenerationResult", "RequestRefused"], results
    assert "sessions open (limit max_sessions)" in str(next(r for r in results if isinstance(r, Exception)))
