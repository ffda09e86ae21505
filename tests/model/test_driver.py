"""The decode driver (swarm/model/driver.py) on a cheap synthetic target, no torch model.

The fake target's logits for a row depend only on the last two tokens of the prefix it holds (a
cache it truncates to each chunk's base, as a stage does), so a chunk computed on a wrong cache
gives wrong logits. Two executors drive the same driver: the in-process one (``Decode.run``) and a
ring-like one written here, which computes every chunk as soon as it is sent (stale ones too, as
a ring's stages do) and answers results late, in send order.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import pytest
import torch

from swarm.errors import UsageError
from swarm.model.config import ModelArgs
from swarm.model.driver import AWAIT, Decode, Send, Verify
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import Draft, KPolicy, SpeculativeDecoder, VerifyChunk

torch.set_num_threads(1)  # the test machine is shared: more threads than cores is far slower

V = 7
PROMPT = [1, 2, 3, 1, 2, 3, 4, 1, 2]


class Target:
    """logits(prefix) = table[prefix[-2], prefix[-1]]; a token cache truncated to each chunk's base."""

    def __init__(self, seed: int = 2) -> None:
        self.table = torch.randn(V, V, V, generator=torch.Generator().manual_seed(seed)) * 3  # (V, V, V)
        self.cache: list[int] = []
        self.ran: list[int] = []  # chunk ids, in the order computed

    def forward(self, chunk: VerifyChunk) -> torch.Tensor:
        assert chunk.base <= len(self.cache), "chunk starts past the valid cache"
        del self.cache[chunk.base:]
        self.ran.append(chunk.chunk_id)
        rows = []
        for i, tok in enumerate(chunk.tokens):
            self.cache.append(tok)
            if i >= chunk.logits_from:
                rows.append(self.table[self.cache[-2] if len(self.cache) > 1 else 0, tok])
        return torch.stack(rows) if rows else torch.zeros(0, V)  # (n_rows, V)


class WrongEveryThird:
    """Drafts the target's greedy continuation but gets every third proposal wrong."""

    def __init__(self, target: Target) -> None:
        self.table, self.calls = target.table, 0

    def propose(self, context: Sequence[int], k: int, params: SamplingParams) -> Draft:
        ctx, out = list(context), []
        for _ in range(k):
            self.calls += 1
            t = int(self.table[ctx[-2], ctx[-1]].argmax())
            t = (t + 1) % V if self.calls % 3 == 0 else t
            out.append(t)
            ctx.append(t)
        return Draft(out)


def decoder(target: Target | None, n: int = 30, depth: int = 3) -> SpeculativeDecoder:
    drafter = None if target is None else WrongEveryThird(target)
    policy = KPolicy(fixed_k=3, max_depth=depth, depth_threshold=0.0)
    return SpeculativeDecoder(PROMPT, params=SamplingParams(), max_new_tokens=n, eos_token_ids=(), drafter=drafter,
                              policy=policy, prefill_chunk=4)  # fmt: skip


def run_ring_like(run: Decode, target: Target, *, stop_after_results: int | None = None) -> int:
    """Execute ``run.steps()`` as a ring does: every chunk computed when sent, results answered
    in send order. Returns the results answered (stops early after ``stop_after_results``)."""
    results: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
    latest = torch.empty(0)
    answered = 0
    steps = run.steps()
    answer: int | torch.Tensor | None = None
    while True:
        try:
            step = steps.send(answer)
        except StopIteration:
            return answered
        if isinstance(step, Send):
            for chunk in step.chunks:
                run.chunks.append((chunk.base, len(chunk.tokens)))
                results.append((chunk.chunk_id, target.forward(chunk)))
            answer = None
        elif step is AWAIT:
            if answered == stop_after_results:
                steps.close()  # the ring fails here: results still in flight are lost
                return answered
            answer, latest = results.popleft()
            answered += 1
        else:
            assert isinstance(step, Verify)
            answer = latest


def test_the_in_process_executor_runs_live_chunks_in_order_and_skips_discarded_ones() -> None:
    plain_target = Target()
    plain = Decode(decoder(None, depth=1)).run(plain_target.forward)
    target = Target()
    dec = decoder(target)
    got: list[int] = []
    run = Decode(dec, on_tokens=got.extend)
    res = run.run(target.forward)
    assert res.output_token_ids == plain.output_token_ids == got and len(got) == 30
    assert dec.stats.discarded_chunks > 0 and 0 < res.accepted < res.proposed  # rejections really happened
    assert target.ran == [c.chunk_id for c in run.fed_log]  # only live chunks computed, once each, in order
    assert res.chunks == [(c.base, len(c.tokens)) for c in run.fed_log]
    assert res.prefill_chunks == 3 and res.chunks[:3] == [(0, 4), (4, 4), (8, 1)]
    assert res.finish_reason == "length" and res.prefill_s >= 0 and res.decode_s >= 0
    assert res.tokens_per_traversal == pytest.approx(30 / (len(res.chunks) - 3))
    assert plain.tokens_per_traversal == 30 / 29 and plain.proposed == 0  # the first token came with the prefill


def test_a_ring_like_target_gets_the_same_chunks_and_tokens_as_one_box() -> None:
    """The schedule depends on the results only: a target that computes every chunk as it is
    sent (discarded ones too) and answers late feeds the decoder the same chunks."""
    one_box = Decode(decoder(Target()))
    ref = one_box.run(Target().forward)
    ring_target = Target()
    ring = Decode(decoder(ring_target))
    run_ring_like(ring, ring_target)
    res = ring.result()
    assert res.output_token_ids == ref.output_token_ids
    assert ring.fed_log == one_box.fed_log  # the same chunks, drafts included, in the same order
    assert len(res.chunks) == len(ring_target.ran) > len(ref.chunks)  # it also ran chunks a rejection discarded
    assert set(ring_target.ran) > {c.chunk_id for c in one_box.fed_log}


@pytest.mark.parametrize("fail_after", [1, 2, 5, 11])
def test_a_run_resumed_on_a_new_target_re_sends_what_was_in_flight(fail_after: int) -> None:
    ref_run = Decode(decoder(Target()))
    ref = ref_run.run(Target().forward)
    first = Target()
    run = Decode(decoder(first))
    assert run_ring_like(run, first, stop_after_results=fail_after) == fail_after
    assert run.decoder.inflight and not run.done
    second = Target()  # a new ring: its caches rebuilt from the chunks fed before
    for chunk in run.fed_log:
        second.forward(chunk)
    steps = run.steps()
    step = next(steps)
    assert isinstance(step, Send) and step.resent
    assert [c.chunk_id for c in step.chunks] == [c.chunk_id for c in run.decoder.inflight]
    steps.close()
    run_ring_like(run, second)
    assert run.result().output_token_ids == ref.output_token_ids
    assert run.fed_log == ref_run.fed_log  # each chunk fed once: no token lost or repeated


def test_answers_of_the_wrong_kind_are_refused() -> None:
    steps = Decode(decoder(None)).steps()
    assert isinstance(next(steps), Send)
    with pytest.raises(UsageError, match="answered before all its chunks were taken"):
        steps.send(None)
    steps = Decode(decoder(None)).steps()
    list(next(steps).chunks)  # type: ignore[union-attr]
    assert steps.send(None) is AWAIT
    with pytest.raises(UsageError, match="AWAIT is answered with a chunk id"):
        steps.send(torch.zeros(1, V))
    run = Decode(decoder(None))
    steps = run.steps()
    (first, *_) = list(next(steps).chunks)  # type: ignore[union-attr]
    steps.send(None)
    assert steps.send(first.chunk_id) == Verify(first)
    with pytest.raises(UsageError, match="Verify is answered with logits"):
        steps.send(3)


def test_progress_and_timing_come_from_the_driver() -> None:
    ticks = iter(range(100))
    progress: list[tuple[int, int]] = []
    run = Decode(decoder(None, n=4), clock=lambda: float(next(ticks)),
                 on_progress=lambda done, total: progress.append((done, total)))  # fmt: skip
    res = run.run(Target().forward)
    assert progress == [(4, 9), (8, 9), (9, 9)]  # the prompt's pieces, as fed
    # clock reads: t0, then one per commit (4 chunks commit 1 token each), then the end
    assert (run.t0, run.t_first, run.t_last, run.t_end) == (0.0, 1.0, 4.0, 5.0)
    assert (res.prefill_s, res.decode_s) == (1.0, 4.0)


def test_a_decode_for_a_model_checks_the_prompt_against_it_and_takes_its_defaults() -> None:
    """``Decode.for_model``: how every driver (generate.generate, the ring's Coordinator) builds
    its decoder, so both read a request's settings the same way."""
    args = ModelArgs(architecture="llama", vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=4,
                     max_seq_len=32, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2, 7))  # fmt: skip
    seen: list[int] = []
    run = Decode.for_model(args, [5, 99, 0], max_new_tokens=4, on_tokens=seen.extend)
    dec = run.decoder
    assert dec.committed == [5, 99, 0] and dec.eos == {2, 7} and dec.params == SamplingParams()
    assert dec.max_total == 7 and run.on_tokens is not None and run.prompt == [5, 99, 0]
    chunked = Decode.for_model(args, [5] * 7, max_new_tokens=2, eos_token_ids=(), prefill_chunk=3).decoder
    assert chunked.eos == frozenset() and [len(c.tokens) for c in chunked.poll()][:1] == [3]
    with pytest.raises(UsageError, match=r"prompt token ids \[100, -1\] are outside the vocabulary \[0, 100\)"):
        Decode.for_model(args, [5, 100, -1])
    with pytest.raises(UsageError, match="context window of 32 tokens"):
        Decode.for_model(args, [5] * 20, max_new_tokens=13)
    with pytest.raises(UsageError, match="context window of 16 tokens"):  # a smaller context than the model's
        Decode.for_model(args, [5] * 10, max_new_tokens=7, max_len=16)
