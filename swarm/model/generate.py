"""In-process generation across N stages: the reference a ring is checked against.

``LocalModel`` holds one checkpoint as a ``Head`` plus a list of ``Stage`` blocks (each loads only
its own layers) and runs a ``VerifyChunk`` through them: embed, stage by stage, logits for the
requested rows. ``generate`` drives a ``SpeculativeDecoder`` (speculative.py) with it, so plain
decoding, drafting and chunk shapes follow exactly the schedule a ring coordinator would use.

Determinism (bf16 numerics depend on chunk shapes): prefill runs the prompt in pieces of
``prefill_chunk`` tokens (default ``DEFAULT_PREFILL_CHUNK`` = 64) from position 0; each decode
chunk is ``[pending token] + K drafts`` with K from the policy; logits are computed only for the
rows the decoder needs (the last row of the prompt, every row of a decode chunk). A ring that
issues the same chunks (same prefill_chunk, drafter and K/depth schedule) computes the same
numbers on the same kind of device; greedy output with fp32 matches whatever the chunking.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.errors import ModelError, UsageError
from swarm.model.config import ModelArgs
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import (
    DEFAULT_PREFILL_CHUNK,
    Committed,
    DraftSource,
    KPolicy,
    SpeculativeDecoder,
    VerifyChunk,
)
from swarm.model.stage import Head, Stage
from swarm.model.weights import Checkpoint, open_checkpoint

_sessions = itertools.count()

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def output_sha256(ids: Sequence[int]) -> str:
    """sha256 of the output IDs as comma-separated decimal text: the receipts' checksum, so a
    ring's receipt and a one-box run can be compared by one line."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def split_layers(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous, as even as possible; earlier stages take the remainder."""
    if not 1 <= n_stages <= n_layers:
        raise UsageError(f"--stages must be between 1 and the model's {n_layers} layers, got {n_stages}")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


class LocalModel:
    """A Head and a chain of Stages in this process."""

    def __init__(self, ckpt: Checkpoint, head: Head, stages: Sequence[Stage]) -> None:
        self.ckpt, self.head, self.stages = ckpt, head, list(stages)

    @classmethod
    def load(
        cls,
        path: str | Path | Checkpoint,
        *,
        stages: int | Sequence[tuple[int, int]] = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        progress: Callable[[int, int], None] | None = None,
        quant: str = "none",
        kernel_dtype: torch.dtype | None = None,
        kv_cache: str = "auto",
        head_quant: str = "none",
    ) -> LocalModel:
        ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path)
        blocks = split_layers(ckpt.args.n_layers, stages) if isinstance(stages, int) else list(stages)
        bounds = [0, *(b for _, b in blocks)]
        if not blocks or [a for a, _ in blocks] != bounds[:-1] or bounds[-1] != ckpt.args.n_layers:
            raise UsageError(
                f"stages {blocks} must be contiguous blocks covering layers 0..{ckpt.args.n_layers - 1}"
            )  # a partial chain would run, and give a wrong model's tokens
        total = sum(b - a for a, b in blocks)
        done = 0
        head = Head.load(ckpt.args, ckpt.source, dtype=dtype, device=device)
        if head_quant == "int8":
            head.hold_head_int8()
        elif head_quant != "none":
            raise UsageError(f"head_quant {head_quant!r}: choose none or int8")
        loaded = []
        for a, b in blocks:
            loaded.append(Stage.load(ckpt.args, ckpt.source, a, b, dtype=dtype, device=device, quant=quant,
                                     kernel_dtype=kernel_dtype, kv_cache=kv_cache))
            done += b - a
            if progress is not None:
                progress(done, total)
        return cls(ckpt, head, loaded)

    @property
    def args(self) -> ModelArgs:
        return self.ckpt.args

    @property
    def blocks(self) -> list[tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    def open_session(self, max_len: int) -> Hashable:
        session = ("gen", next(_sessions))
        for st in self.stages:
            st.open_session(session, max_len)
        return session

    def close_session(self, session: Hashable) -> None:
        for st in self.stages:
            st.close_session(session)

    def run_chunk(self, session: Hashable, chunk: VerifyChunk) -> torch.Tensor:
        """Truncate caches to ``chunk.base``, run its tokens, return logits (n_rows, V)."""
        ids = torch.tensor(chunk.tokens, dtype=torch.long)
        h = self.head.embed(ids)  # (T, D)
        for st in self.stages:
            n = st.session_len(session)
            if n > chunk.base:
                st.rollback(session, chunk.base)
            elif n < chunk.base:
                raise ModelError(
                    f"chunk {chunk.chunk_id} starts at position {chunk.base} but stage "
                    f"[{st.start}, {st.end}) holds only {n} positions"
                )
            h = st.forward(session, h)  # (T, D)
        if chunk.n_rows == 0:
            return torch.empty(0, self.args.vocab_size)
        return self.head.logits(h[chunk.logits_from:])  # (n_rows, V)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    prefill_s: float  # until the first new token was known
    decode_s: float  # from then to the last token
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (base, n_tokens) as executed

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


def generate(
    model: LocalModel,
    prompt_ids: Sequence[int],
    *,
    params: SamplingParams | None = None,
    max_new_tokens: int = 64,
    drafter: DraftSource | None = None,
    policy: KPolicy | None = None,
    eos_token_ids: Sequence[int] | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    on_tokens: Callable[[Sequence[int]], None] | None = None,
) -> GenerationResult:
    """Generate with the model's stages in this process (see the module doc for the schedule).

    ``eos_token_ids`` defaults to the checkpoint's; ``on_tokens`` receives newly committed tokens
    as they are decided (for streaming).
    """
    dec = SpeculativeDecoder.for_model(
        model.args, prompt_ids, params=params, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
        drafter=drafter, policy=policy, prefill_chunk=prefill_chunk,
    )  # fmt: skip
    prompt = dec.committed[:]
    session = model.open_session(dec.max_total)
    chunks: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    t_first: float | None = None
    try:
        # The ring's schedule (swarm/node/ring/coordinator.py): chunks run in the order issued, and
        # the decoder is polled again after every chunk, live or discarded. Same chunks, same
        # shapes, same numbers: a ring's receipt and this function agree token for token.
        queue = deque(dec.poll())
        while not dec.done:
            if not queue:
                raise AssertionError("speculative decoder idle with nothing in flight")
            chunk = queue.popleft()
            if dec.is_live(chunk.chunk_id):  # a discarded chunk changes nothing: skip its compute
                logits = model.run_chunk(session, chunk)
                chunks.append((chunk.base, len(chunk.tokens)))
                for ev in dec.feed(chunk.chunk_id, logits):
                    if isinstance(ev, Committed):
                        if t_first is None:
                            t_first = time.perf_counter()
                        if on_tokens is not None:
                            on_tokens(ev.tokens)
            if not dec.done:
                queue.extend(dec.poll())
    finally:
        model.close_session(session)
    t_end = time.perf_counter()
    t_first = t_first if t_first is not None else t_end
    st = dec.stats
    return GenerationResult(
        prompt_token_ids=prompt,
        output_token_ids=dec.output_ids,
        finish_reason=dec.finish_reason or "length",
        prefill_s=t_first - t0,
        decode_s=t_end - t_first,
        rounds=st.rounds,
        proposed=st.proposed,
        accepted=st.accepted,
        chunks=chunks,
    )
