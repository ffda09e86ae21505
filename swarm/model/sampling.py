"""Sampling: greedy, temperature, top-k and top-p with seeded, position-keyed generators.

``target_probs`` is the one definition of "the distribution the model samples from": plain
sampling draws from it, and speculative verification (speculative.py) accepts and resamples
against exactly the same tensor, which is what makes speculation lossless.

Randomness is keyed by (seed, position, stream) rather than drawn from one running generator: the
token at position ``p`` uses ``position_generator(seed, p, stream)``. Output then depends only on
the seed and on what was computed, never on how many draws happened earlier or on which process
(coordinator in a ring, or one box) made them. Greedy decoding uses no randomness at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarm.errors import UsageError

# Streams of randomness at one position (see position_generator).
STREAM_SAMPLE = 0  # plain sampling, bonus tokens and residual resampling
STREAM_ACCEPT = 1  # the uniform of the accept/reject test
STREAM_DRAFT = 2  # a model drafter sampling its proposal

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (top_k/top_p ignored); top_k 0 and top_p 1.0 mean "off"."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise UsageError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.seed < 2**63):
            raise UsageError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed}


def _mix64(x: int) -> int:
    # splitmix64 finalizer: spreads nearby (seed, position) pairs over the whole seed space.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_generator(seed: int, position: int, stream: int) -> torch.Generator:
    """A CPU generator that depends only on (seed, position, stream)."""
    key = _mix64(_mix64(_mix64(seed) ^ position) ^ stream)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(key & ((1 << 63) - 1))
    return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits (..., V) -> float32 probabilities (..., V) after temperature, top-k and top-p.

    Greedy gives a one-hot at the argmax (first index on ties), so code that works on
    distributions treats greedy as the degenerate case of sampling.
    """
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    scores = logits / params.temperature  # (..., V)
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first
        # token is always kept).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a 1-D distribution (need not be normalized; must have positive mass).

    The draw runs on the CPU (a no-op move there) with the CPU generator, so a seed gives the same
    token whichever device computed ``probs``."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at ``position`` given that position's logits (V,): argmax, or a seeded draw."""
    if params.greedy:
        return int(logits.argmax().item())
    probs = target_probs(logits, params)
    return draw(probs, position_generator(params.seed, position, STREAM_SAMPLE))
