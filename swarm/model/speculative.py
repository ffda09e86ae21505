"""Speculative decoding as a sans-IO state machine (no torch model calls, no I/O).

Theory of operation
-------------------
Positions count tokens from the start of the prompt. ``committed`` holds the prompt and every
token decided so far. A *chunk* asks the target to run ``tokens`` at positions ``base ..
base+len-1`` (the executor first truncates every cache to ``base``) and to return the logits of
rows ``logits_from .. len-1``. The logits row at position ``q`` is the target distribution of
the token at ``q + 1``.

Chunks in flight are contiguous: each starts where the previous one ends (``run_end``). The
tokens they carry beyond ``committed`` are drafts, and the *speculated* sequence is ``committed +
drafts``. A new chunk carries the speculated tokens not yet sent (at most the one committed
token whose logits are still unknown, the "pending" token) followed by fresh drafts proposed from
the speculated sequence, i.e. it assumes every chunk before it is accepted in full.

Results must be fed in the order the chunks were issued. For each returned row at position
``q = len(committed) - 1`` (the rows before that only prefill):

- if a draft sits at ``q + 1`` it is verified: greedy accepts iff it equals the argmax; sampling
  accepts with probability ``min(1, p/q)`` and on rejection draws from ``norm(max(0, p - q))``
  (a deterministic draft has ``q`` one-hot). Accepted -> committed, next row.
- a rejection commits the replacement token, discards every later row and every later chunk
  (they were built on the rejected token), and emits ``Rollback(len(committed) - 1)``: caches
  keep positions ``< len(committed) - 1`` and the replacement becomes the pending token.
- with no draft at ``q + 1`` (the last row of the last chunk) a bonus token is drawn from ``p``.

Lossless: each committed token is distributed exactly as the target's (Leviathan et al. 2023,
Chen et al. 2023); greedy output is token-identical to plain greedy. Randomness is keyed by
(seed, position, stream) (sampling.py), so given the same chunk schedule the output is
reproducible anywhere. Stale results (for discarded chunks) are ignored by ``feed``.

Chunk schedule (deterministic, documented because bf16 numerics depend on chunk shapes):
prefill runs the prompt in pieces of ``prefill_chunk`` tokens from position 0 (the last piece
shorter), at most ``prefill_window`` of them in flight: the first poll issues that many, and each
poll after a piece's result issues the next one (a ring pipelines the pieces across its stages, and
no stage ever holds more than a window of one prompt; no decode chunk is issued before the last
piece); then each decode chunk is ``[pending?] + K drafts`` with K from ``KPolicy``. A chunk
whose draft came back empty carries only the pending token (plain decoding); when nothing is
pending and the drafter proposes nothing, no further chunk is issued until results arrive.

Adaptive K and depth: ``KPolicy`` (kpolicy.py), a pure function of the acceptance history and
constants fixed when a generation starts, so two runs fed the same results issue the same chunks.

Devices: the decoder decides on the host. A target on a GPU (an in-process model) or a ring's
head hands it logits wherever they were computed, and a draft model on a GPU hands it draft
probabilities there; :func:`host` moves each chunk's logits and each draft's probabilities to the
CPU once (one transfer of a (rows, V) or (k, V) block, not one per token), so ``p`` and ``q`` always
meet on the CPU, where the seeded draws (sampling.py) run anyway.

Drafting ahead (``poll_iter``): chunks are produced one at a time, so a ring can send each as soon as
its drafts exist and run the drafter off its event loop; ``poll()`` is the same sequence as a list.
A drafter may have ``prepare(prompt)``: it is called once before the first proposal (a model
drafter runs the prompt into its cache there; a coordinator may call it earlier, while the ring
prefills, and the sequence of computations stays the same).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from swarm.errors import UsageError
from swarm.model.kpolicy import KPolicy
from swarm.model.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingParams,
    draw,
    position_generator,
    target_probs,
)

DEFAULT_PREFILL_CHUNK = 64
# prompt pieces in flight at once (module doc: chunk schedule). A ring's stages are all busy with one
# prompt while the window covers one piece at each stage plus those on the hops and at the
# coordinator (about stages + 2); 8 leaves that room up to ~6 stages (measured on 3: a 2,048-token
# prefill as fast as with every piece sent at once, benchmarks/bench_long_prompt.py --ab,
# long_prompt_window.json; on 4 and 5 stages every stage's queue stays at most 7 pieces as on 3,
# long_prompt_4stages.json, long_prompt_5stages.json). What a stage may hold of one session's
# hidden states on their way, DEFAULT_PREFILL_WINDOW x DEFAULT_PREFILL_CHUNK tokens, is in its
# memory budget (planner/budget.py, ModelSpec.inflight_bytes).
DEFAULT_PREFILL_WINDOW = 8


def inflight_bytes(dim: int, dtype_bytes: int, context_tokens: int) -> int:
    """What one session's hidden states on their way round a ring may hold at one stage (its
    queue, its forward's input, its send): a window of prompt pieces of ``dim`` values each, or
    the whole context where that is shorter (a decode step's few chunks are less)."""
    return min(DEFAULT_PREFILL_WINDOW * DEFAULT_PREFILL_CHUNK, context_tokens) * dim * dtype_bytes


def head_logit_values(vocab_size: int) -> int:
    """The logits one session's chunk asks the coordinator's head for at most, as values (rows x
    vocabulary): a decode chunk's pending token and the default policy's largest draft
    (KPolicy.k_max), the bonus row included; a prompt's last piece asks for one row. A request's own
    ``draft_k`` above that default makes longer chunks, which the memory budget does not count."""
    return (KPolicy.k_max + 1) * vocab_size


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU (a no-op there): where the decoder compares target and draft distributions."""
    return t if t.device.type == "cpu" else t.to("cpu")


@dataclass(frozen=True)
class Draft:
    """Proposed tokens, and per token the draft distribution (k, V) it was sampled from, or
    None for a deterministic draft (greedy drafter, n-gram lookup)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class DraftSource(Protocol):
    def propose(self, context: Sequence[int], k: int, params: SamplingParams) -> Draft: ...


@dataclass(frozen=True)
class VerifyChunk:
    """Run ``tokens`` at positions ``base..`` (truncate caches to ``base`` first); return logits
    rows ``logits_from..len(tokens)-1`` as a (n_rows, V) float tensor."""

    chunk_id: int
    base: int
    tokens: tuple[int, ...]
    logits_from: int
    prefill: bool

    @property
    def n_rows(self) -> int:
        return len(self.tokens) - self.logits_from


@dataclass(frozen=True)
class Rollback:
    """Every cache keeps only positions ``< length``; chunks in flight were discarded."""

    length: int


@dataclass(frozen=True)
class Committed:
    """Tokens newly decided, in order (for streaming)."""

    tokens: tuple[int, ...]


Event = VerifyChunk | Rollback | Committed


@dataclass
class DecodeStats:
    rounds: int = 0  # verify chunks that carried at least one draft and were not discarded
    proposed: int = 0
    accepted: int = 0
    accepted_per_round_hist: list[int] = field(default_factory=list)
    chunks: int = 0
    discarded_chunks: int = 0
    decode_chunks: int = 0  # decode chunks issued
    in_flight_sum: int = 0  # ... summed over them: chunks in flight once each was issued

    @property
    def accepted_per_round(self) -> float | None:
        return self.accepted / self.rounds if self.rounds else None

    @property
    def mean_in_flight(self) -> float | None:
        """The pipeline's depth as issued: chunks in flight right after each decode chunk."""
        return self.in_flight_sum / self.decode_chunks if self.decode_chunks else None


class SpeculativeDecoder:
    """Drive with ``poll()`` (chunks to send now) and ``feed(chunk_id, logits)``; see module doc."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        *,
        params: SamplingParams,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        drafter: DraftSource | None = None,
        policy: KPolicy | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_window: int = DEFAULT_PREFILL_WINDOW,
        max_len: int | None = None,
    ) -> None:
        if not prompt_ids:
            raise UsageError("the prompt is empty: give at least one token")
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk < 1:
            raise UsageError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_window < 1:
            raise UsageError(f"prefill_window must be >= 1, got {prefill_window}")
        self.params = params
        self.drafter = drafter
        self.policy = policy or KPolicy()
        self.eos = frozenset(eos_token_ids)
        self.prompt_len = len(prompt_ids)
        self.max_total = self.prompt_len + max_new_tokens
        if max_len is not None and self.max_total > max_len:
            raise UsageError(
                f"prompt ({self.prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the context window of {max_len} tokens"
            )
        self.committed: list[int] = list(prompt_ids)
        self.drafts: list[int] = []  # speculated tokens after `committed`
        self.draft_probs: list[torch.Tensor | None] = []  # parallel to drafts
        self.run_end = 0  # end position of the chunks in flight (or of the valid cache)
        self.inflight: deque[VerifyChunk] = deque()
        self.finish_reason: str | None = None
        self.stats = DecodeStats()
        self._next_id = 0
        self._prefill_chunk = prefill_chunk
        self.prefill_window = prefill_window  # prompt pieces in flight at most (module doc)
        self._prepared = False  # the drafter's prepare(prompt) was called

    # -- state ---------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.committed[self.prompt_len:]

    @property
    def speculated(self) -> list[int]:
        return self.committed + self.drafts

    @property
    def window_tokens(self) -> int:
        """The most prompt tokens in flight at once (a replay after a re-plan keeps to it too)."""
        return self.prefill_window * self._prefill_chunk

    # -- issuing -------------------------------------------------------------------------

    def _issue(self, base: int, tokens: list[int], logits_from: int, prefill: bool) -> VerifyChunk:
        chunk = VerifyChunk(self._next_id, base, tuple(tokens), logits_from, prefill)
        self._next_id += 1
        self.inflight.append(chunk)
        self.run_end = base + len(tokens)
        self.stats.chunks += 1
        return chunk

    def poll(self) -> list[VerifyChunk]:
        """Chunks to send now (possibly none): prompt pieces up to the window, else decode chunks."""
        return list(self.poll_iter())

    def poll_iter(self) -> Iterator[VerifyChunk]:
        """``poll()`` one chunk at a time: each is issued (and its drafts proposed) when the next
        one is asked for. Exhaust it before ``feed``: the chunks it would yield depend on the
        decoder's state, and a half-used iterator left behind yields nothing more."""
        if self.done:
            return
        # Prefill: prompt pieces up to the window, so a ring can pipeline them; only the last row matters.
        prefilled = False
        while self.run_end < self.prompt_len and sum(c.prefill for c in self.inflight) < self.prefill_window:
            end = min(self.run_end + self._prefill_chunk, self.prompt_len)
            toks = self.committed[self.run_end:end]
            last = end == self.prompt_len
            prefilled = True
            yield self._issue(self.run_end, toks, len(toks) - 1 if last else len(toks), True)
        if prefilled or self.run_end < self.prompt_len:
            return
        k, depth = self.policy.choose()
        while len(self.inflight) < depth and not self.done:
            spec_len = len(self.committed) + len(self.drafts)
            if spec_len >= self.max_total:
                break
            unsent = self.speculated[self.run_end:]  # the pending token, if any
            # k drafts yield at most k + 1 tokens (the bonus): drafting past the budget is waste.
            kk = min(k, self.max_total - spec_len - 1)
            new: list[int] = []
            if self.drafter is not None and kk > 0:
                self.prepare_drafter()
                draft = self.drafter.propose(self.speculated, kk, self.params)
                new = list(draft.tokens[:kk])
                probs = None if draft.probs is None else host(draft.probs)  # (k, V), one transfer
                for i in range(len(new)):
                    self.draft_probs.append(None if probs is None else probs[i])
                self.drafts.extend(new)
            tokens = unsent + new
            if not tokens:
                break
            chunk = self._issue(self.run_end, tokens, 0, False)
            self.stats.decode_chunks += 1
            self.stats.in_flight_sum += len(self.inflight)
            yield chunk
            if not new:
                break  # plain decoding: nothing more to speculate on

    def stop_drafting(self) -> None:
        """Plain decoding from here on (one token per chunk, one chunk in flight): allowed only
        before the first decode chunk, so the schedule is the one a decoder built without a
        drafter issues, and a replay without one reproduces it."""
        if self.stats.decode_chunks or self.drafts:
            raise UsageError("stop_drafting: decode chunks were already issued")
        self.drafter, self.policy = None, KPolicy()

    @property
    def drafter_prepared(self) -> bool:
        return self._prepared

    def prepare_drafter(self) -> None:
        """Let the drafter run the prompt now (once; the first proposal does it otherwise)."""
        if not self._prepared and self.drafter is not None:
            self._prepared = True
            prepare = getattr(self.drafter, "prepare", None)
            if prepare is not None:
                prepare(self.committed[: self.prompt_len])

    def is_live(self, chunk_id: int) -> bool:
        """False once a chunk was discarded (or consumed): an executor may skip it."""
        return any(c.chunk_id == chunk_id for c in self.inflight)

    # -- consuming -----------------------------------------------------------------------

    def feed(self, chunk_id: int, logits: torch.Tensor) -> list[Rollback | Committed]:
        """Logits (n_rows, V) of an issued chunk. Results of discarded chunks return []."""
        if not self.inflight or self.inflight[0].chunk_id != chunk_id:
            if self.is_live(chunk_id):
                raise UsageError(f"chunk {chunk_id} fed out of order: feed results in issue order")
            return []  # stale: discarded by an earlier rejection
        chunk = self.inflight.popleft()
        if logits.dim() != 2 or logits.shape[0] != chunk.n_rows:
            raise UsageError(
                f"chunk {chunk_id}: expected logits of shape ({chunk.n_rows}, V), "
                f"got {tuple(logits.shape)}"
            )
        logits = host(logits)  # (n_rows, V): one transfer per chunk
        events: list[Rollback | Committed] = []
        new_tokens: list[int] = []
        proposed = accepted = 0
        rejected = False
        first_row_pos = chunk.base + chunk.logits_from
        for i in range(chunk.n_rows):
            q = first_row_pos + i
            if q + 1 < len(self.committed):
                continue  # a prefill row, or a row we already know the answer to
            if q + 1 > len(self.committed):
                raise AssertionError("rows must be consumed in position order")
            row = logits[i]
            if self.drafts:
                proposed += 1
                ok, token = self._verify(row, q + 1)
                if ok:
                    accepted += 1
                    self.drafts.pop(0)
                    self.draft_probs.pop(0)
                    new_tokens.append(token)
                    self.committed.append(token)
                else:
                    rejected = True
                    new_tokens.append(token)
                    self.committed.append(token)
                    break
            else:
                token = self._sample(row, q + 1)
                new_tokens.append(token)
                self.committed.append(token)
            if self._check_finished(new_tokens):
                break
        if proposed:
            self.stats.rounds += 1
            self.stats.proposed += proposed
            self.stats.accepted += accepted
            self.stats.accepted_per_round_hist.append(accepted)
            self.policy.update(proposed, accepted)
        if new_tokens:
            events.append(Committed(tuple(new_tokens)))
        if not self.done:
            self._check_finished(new_tokens)
        if rejected or self.done:
            if self.inflight or self.drafts:
                self.stats.discarded_chunks += len(self.inflight)
                self.inflight.clear()
                self.drafts.clear()
                self.draft_probs.clear()
            self.run_end = len(self.committed) - 1
            if rejected:
                events.append(Rollback(self.run_end))
        elif not self.inflight and self.run_end >= self.prompt_len:
            # Everything accepted and nothing in flight: the bonus token is pending (a prompt whose
            # pieces are not all out yet goes on from its next piece: the prefill window).
            self.run_end = len(self.committed) - 1
        return events

    def _check_finished(self, new_tokens: list[int]) -> bool:
        if self.done:
            return True
        if new_tokens and new_tokens[-1] in self.eos:
            self.finish_reason = "eos"
        elif len(self.committed) >= self.max_total:
            self.finish_reason = "length"
        return self.done

    def _sample(self, row: torch.Tensor, position: int) -> int:
        if self.params.greedy:
            return int(row.argmax().item())
        p = target_probs(row, self.params)
        return draw(p, position_generator(self.params.seed, position, STREAM_SAMPLE))

    def _verify(self, row: torch.Tensor, position: int) -> tuple[bool, int]:
        """Verify the draft at ``position`` against target logits ``row`` (V,)."""
        d = self.drafts[0]
        if self.params.greedy:
            best = int(row.argmax().item())
            return best == d, best
        p = target_probs(row, self.params)  # (V,)
        qd = self.draft_probs[0]
        q = qd.float() if qd is not None else None
        p_d = float(p[d])
        q_d = float(q[d]) if q is not None else 1.0
        u = float(torch.rand((), generator=position_generator(self.params.seed, position,
                                                               STREAM_ACCEPT)))
        if q_d > 0 and u < min(1.0, p_d / q_d):
            return True, d
        if q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0 or not math.isfinite(float(residual.sum())):
            residual = p  # p == q up to rounding: any draw from p is exact
        return False, draw(residual, position_generator(self.params.seed, position, STREAM_SAMPLE))

