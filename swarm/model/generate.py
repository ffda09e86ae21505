"""In-process generation across N stages: the reference a ring is checked against.

``LocalModel`` holds one checkpoint as a ``Head`` plus a list of ``Stage`` blocks (each loads only
its own layers) and runs a ``VerifyChunk`` through them: embed, stage by stage, logits for the
requested rows. ``generate`` is the decode driver (driver.py) with it as the target: the same
driver a ring's coordinator runs, so plain decoding, drafting and chunk shapes follow exactly the
schedule a ring uses.

Determinism (bf16 numerics depend on chunk shapes): prefill runs the prompt in pieces of
``prefill_chunk`` tokens (default ``DEFAULT_PREFILL_CHUNK`` = 64) from position 0; each decode
chunk is ``[pending token] + K drafts`` with K from the policy; logits are computed only for the
rows the decoder needs (the last row of the prompt, every row of a decode chunk). A ring that
issues the same chunks (same prefill_chunk, drafter and K/depth schedule) computes the same
numbers on the same kind of device; greedy output with fp32 matches whatever the chunking.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Unpack

import torch

from swarm.errors import ModelError, UsageError
from swarm.model.config import ModelArgs
from swarm.model.driver import Decode, DecodeSettings, GenerationResult
from swarm.model.speculative import VerifyChunk
from swarm.model.stage import Head, Stage
from swarm.model.weights import Checkpoint, open_checkpoint

_sessions = itertools.count()

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


def generate(model: LocalModel, prompt_ids: Sequence[int], **settings: Unpack[DecodeSettings]) -> GenerationResult:
    """Generate with the model's stages in this process (see the module doc for the schedule):
    the decode driver (driver.py) with this process's stages as its target."""
    run = Decode.for_model(model.args, prompt_ids, **settings)
    session = model.open_session(run.decoder.max_total)
    try:
        return run.run(lambda chunk: model.run_chunk(session, chunk))
    finally:
        model.close_session(session)
