"""One decode driver for every target: the one-box run (generate.py) and the ring's coordinator.

Theory of operation
-------------------
A generation is a ``SpeculativeDecoder`` (speculative.py: chunks, verification, stop conditions)
pumped by a *driver* that owns everything around it written once here: how the decoder is built
from a request's settings, the schedule chunks are issued on, what happens when tokens commit
(streaming, timing, the log of chunks fed for a replay) and the result a receipt is made from.

What differs between targets is only how a chunk's logits are obtained: a forward through the
stages in this process, or the chunk's hidden state sent round a ring, awaited, and put through
the LM head. So the driver is a generator of *steps* that the target executes, sync or async as
it likes, sending back each step's answer (``Decode.steps``):

- ``Send(chunks)``: hand these chunks to the target, in order (an iterator: a model drafter
  drafts each as it is pulled, so an executor may pull them off its event loop); answer None.
- ``AWAIT``: answer the id of the next chunk whose result is in. Results come back in the order
  the chunks were sent (every hop is FIFO), live or discarded.
- ``Verify(chunk)``: a live chunk's result is in: answer its logits (n_rows, V). A discarded
  chunk is never asked for (the one box skips its forward; a ring skips its LM head).

The schedule (what makes a ring exactly reproducible by one box): the decoder is polled once at
the start and once after every result, live or discarded, and chunks are issued in the order
polled; so the chunks issued depend only on the results, never on timing, and any target
executing these steps computes the same chunks, hence the same numbers. ``Decode.run`` is the
in-process executor; swarm/node/ring/coordinator.py is the ring's.

Resuming: a run whose target failed keeps its decoder; a new ``steps()`` on another target first
re-sends the chunks that were in flight (``Send(resent=True)``; a ring first replays ``fed_log``
to rebuild its caches), then decoding goes on. Only fed results commit tokens, and each chunk is
fed once, so tokens are never lost or repeated.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Self, TypedDict, Unpack

import torch

from swarm.errors import UsageError
from swarm.model.config import ModelArgs
from swarm.model.kpolicy import KPolicy
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import (
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PREFILL_WINDOW,
    Committed,
    DraftSource,
    SpeculativeDecoder,
    VerifyChunk,
)


class DecodeSettings(TypedDict, total=False):
    """What a request says about its decoding (both drivers' keywords, declared once)."""

    params: SamplingParams | None  # greedy unless given
    max_new_tokens: int  # default 64
    drafter: DraftSource | None
    policy: KPolicy | None
    eos_token_ids: Sequence[int] | None  # the model's unless given
    prefill_chunk: int | None  # DEFAULT_PREFILL_CHUNK unless given
    prefill_window: int | None  # prompt pieces in flight at most; DEFAULT_PREFILL_WINDOW unless given
    on_tokens: Callable[[Sequence[int]], None] | None  # newly committed tokens, as decided (streaming)
    on_progress: Callable[[int, int], None] | None  # a prompt's prefill: (tokens prefilled, prompt length)


@dataclass
class GenerationResult:
    """One generation's tokens and figures, whichever target computed them."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    prefill_s: float  # until the first new token was known
    decode_s: float  # from then to the last token
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (base, n_tokens) the target ran, in order
    prefill_chunks: int = 0  # of them, the prompt's pieces
    shared_head_calls: int = 0  # a ring's LM head calls computed together with other sessions' rows
    traversal_ms: list[float] = field(default_factory=list)  # a ring's send -> result, per live chunk

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included (what a user waits for)."""
        return len(self.output_token_ids) / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Steady generation speed: tokens after the first, per second after the first."""
        n = len(self.output_token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def accepted_per_round(self) -> float | None:
        return self.accepted / self.rounds if self.rounds else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_traversal(self) -> float | None:
        """Committed tokens per decode chunk the target ran (without drafting just over 1.0: the
        first token comes with the prompt's last piece)."""
        n = len(self.chunks) - self.prefill_chunks
        return len(self.output_token_ids) / n if n > 0 else None

    @property
    def output_sha256(self) -> str:
        return output_sha256(self.output_token_ids)


def output_sha256(ids: Sequence[int]) -> str:
    """sha256 of the output IDs as comma-separated decimal text: the receipts' checksum, so a
    ring's receipt and a one-box run can be compared by one line."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


@dataclass(frozen=True)
class Send:
    """Hand ``chunks`` to the target in order (pull them all before answering); answer None.
    ``resent``: the chunks in flight when a resumed run's last target failed (no fresh drafts)."""

    chunks: Iterator[VerifyChunk]
    resent: bool = False


@dataclass(frozen=True)
class Await:
    """Answer the id of the next chunk whose result is in (send order, live or discarded)."""


AWAIT = Await()


@dataclass(frozen=True)
class Verify:
    """Answer ``chunk``'s logits, rows ``logits_from..``: a (n_rows, V) tensor."""

    chunk: VerifyChunk


Step = Send | Await | Verify


def decoder_for(
    args: ModelArgs, prompt_ids: Sequence[int], max_len: int | None, settings: DecodeSettings
) -> SpeculativeDecoder:
    """One generation's decoder on ``args``'s model, as every driver builds it: prompt ids checked
    against the vocabulary, the model's EOS ids unless given, greedy unless ``params``, prompt plus
    new tokens within ``max_len`` (default: the model's context)."""
    prompt = [int(t) for t in prompt_ids]
    bad = [t for t in prompt if not 0 <= t < args.vocab_size]
    if bad:
        raise UsageError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {args.vocab_size})")
    eos, chunk, window = settings.get("eos_token_ids"), settings.get("prefill_chunk"), settings.get("prefill_window")
    return SpeculativeDecoder(
        prompt, params=settings.get("params") or SamplingParams(), max_new_tokens=settings.get("max_new_tokens", 64),
        eos_token_ids=args.eos_token_ids if eos is None else tuple(eos), drafter=settings.get("drafter"),
        policy=settings.get("policy"), prefill_chunk=DEFAULT_PREFILL_CHUNK if chunk is None else chunk,
        prefill_window=DEFAULT_PREFILL_WINDOW if window is None else window, max_len=max_len or args.max_seq_len,
    )  # fmt: skip


class Decode:
    """One generation's decoding: its decoder, its streaming and timing, the chunks it fed.
    Drive it with ``steps()`` (any target) or ``run(forward)`` (a target in this process)."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        *,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.decoder = decoder
        self.prompt = decoder.committed[:]
        self.on_tokens = on_tokens
        self.on_progress = on_progress  # (prompt tokens prefilled, prompt length)
        self.fed_log: list[VerifyChunk] = []  # live chunks fed, in order (what a new ring replays)
        self.chunks: list[tuple[int, int]] = []  # (base, n_tokens) the target ran: its executor records them
        self.clock = clock
        self.t0: float | None = None  # when the first steps() began
        self.t_first: float | None = None  # the first token committed
        self.t_last: float | None = None  # the latest token committed
        self.t_end: float | None = None  # the decoder finished

    @classmethod
    def for_model(
        cls, args: ModelArgs, prompt_ids: Sequence[int], *, max_len: int | None = None,
        **settings: Unpack[DecodeSettings],
    ) -> Self:  # fmt: skip
        """The decoding of one generation on ``args``'s model (see :func:`decoder_for`)."""
        return cls(decoder_for(args, prompt_ids, max_len, settings), on_tokens=settings.get("on_tokens"),
                   on_progress=settings.get("on_progress"))  # fmt: skip

    @property
    def done(self) -> bool:
        return self.decoder.done

    # -- the driver ----------------------------------------------------------------------

    def steps(self) -> Generator[Step, int | torch.Tensor | None, None]:
        """The steps of this generation for one target (module doc); ends when the decoder is
        done. After a target failed, a new ``steps()`` resumes on the next one."""
        dec = self.decoder
        if self.t0 is None:
            self.t0 = self.clock()
        if dec.inflight:  # resuming: what was in flight when the last target failed, sent again
            yield from self._send(Send(iter(list(dec.inflight)), resent=True))
        elif not dec.done:
            yield from self._send(Send(dec.poll_iter()))
        while not dec.done:
            if not dec.inflight:
                raise AssertionError("speculative decoder idle with nothing in flight")
            chunk_id = yield AWAIT
            if not isinstance(chunk_id, int):
                raise UsageError(f"AWAIT is answered with a chunk id, got {type(chunk_id).__name__}")
            chunk = next((c for c in dec.inflight if c.chunk_id == chunk_id), None)
            if chunk is not None:  # else discarded by a rejection: it changes nothing
                logits = yield Verify(chunk)
                if not isinstance(logits, torch.Tensor):
                    raise UsageError(f"Verify is answered with logits, got {type(logits).__name__}")
                self._feed(chunk, logits)
            if not dec.done:
                yield from self._send(Send(dec.poll_iter()))
        self.t_end = self.clock()

    @staticmethod
    def _send(step: Send) -> Generator[Step, int | torch.Tensor | None, None]:
        yield step
        if next(step.chunks, None) is not None:  # the next poll would see a half-issued decoder
            raise UsageError("a Send step was answered before all its chunks were taken")

    def _feed(self, chunk: VerifyChunk, logits: torch.Tensor) -> None:
        dec = self.decoder
        self.fed_log.append(chunk)
        if chunk.prefill and self.on_progress is not None:
            self.on_progress(chunk.base + len(chunk.tokens), dec.prompt_len)
        for ev in dec.feed(chunk.chunk_id, logits):
            if isinstance(ev, Committed):
                self.t_last = self.clock()
                if self.t_first is None:
                    self.t_first = self.t_last
                if self.on_tokens is not None:
                    self.on_tokens(ev.tokens)

    def run(self, forward: Callable[[VerifyChunk], torch.Tensor]) -> GenerationResult:
        """Drive to the end with a target in this process: ``forward(chunk)`` truncates its caches
        to ``chunk.base``, runs the chunk and returns its logits. Chunks run one at a time in
        the order issued; a discarded one is skipped (no compute)."""
        queue: deque[VerifyChunk] = deque()
        steps = self.steps()
        answer: int | torch.Tensor | None = None
        while True:
            try:
                step = steps.send(answer)
            except StopIteration:
                return self.result()
            if isinstance(step, Send):
                queue.extend(step.chunks)
                answer = None
            elif isinstance(step, Await):
                answer = queue.popleft().chunk_id
            else:
                self.chunks.append((step.chunk.base, len(step.chunk.tokens)))
                answer = forward(step.chunk)

    def result(self) -> GenerationResult:
        """The generation's tokens and figures (timing up to the decoder's end, or now)."""
        dec, now = self.decoder, self.clock()
        t0 = self.t0 if self.t0 is not None else now
        t_end = self.t_end if self.t_end is not None else now
        t_first = self.t_first if self.t_first is not None else t_end
        st = dec.stats
        return GenerationResult(
            prompt_token_ids=self.prompt, output_token_ids=dec.output_ids, finish_reason=dec.finish_reason or "length",
            prefill_s=t_first - t0, decode_s=t_end - t_first, rounds=st.rounds, proposed=st.proposed,
            accepted=st.accepted, chunks=list(self.chunks), prefill_chunks=sum(c.prefill for c in self.fed_log),
        )  # fmt: skip
