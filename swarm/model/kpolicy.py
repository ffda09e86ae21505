"""How many tokens to draft per chunk (K) and how many chunks to keep in flight (the depth).

Adaptive K and depth (``KPolicy``): an exponential moving average ``alpha`` of the per-token
acceptance (start 0.6, weight 0.3 for each new round). K maximises expected tokens per unit
cost, ``(1 - alpha^(K+1)) / (1 - alpha) * sum_{j<max_depth} alpha^(K*j) / (1 + verify_cost*K +
draft_cost*K)``, over ``k_min..k_max`` (the sum counts the chunks behind the first, each useful
only if all before it survive, so a deep pipeline on a long ring prefers shorter chunks; with
``max_depth`` 1 it is 1). The depth in flight is ``1 + j`` where ``j`` counts the levels
``1..max_depth-1`` whose survival chance ``alpha^(K*level)`` is at least ``depth_threshold``.
Both are pure functions of the acceptance history, so two runs fed the same results produce the
same schedule.

On a ring (``ring_ms`` > 0) the policy weighs time instead: a chunk of K drafts takes ``(ring_ms +
K (verify_ms + draft_ms)) (1 + congestion (d - 1))`` from its first draft to its result (the drafts
of the first chunk are on the critical path; the ring's own compute grows by ``verify_ms`` per
token; ``congestion`` is how much each further chunk in flight was measured to slow a traversal,
0 on machines of their own, more where stages share cores), while d chunks in flight need ``d K
draft_ms`` of drafting and ``d stage_ms (1 + verify_cost K)`` on the slowest stage.
(K, d) maximise expected tokens per millisecond, ``(1 - a^(K+1)) / (1 - a) * sum_{j<d} a^(K j) /
max(those three)``; a bigger K or d must win by 1 % (less speculative work when it barely helps).
The constants are measured by the coordinator when a generation starts and recorded in its receipt,
so the schedule is still a pure function of the results, and ``run --receipt`` replays it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.errors import UsageError


@dataclass
class KPolicy:
    """Adaptive draft length and depth in flight; see the module docstring."""

    k_min: int = 1
    k_max: int = 8
    max_depth: int = 1
    verify_cost: float = 0.07  # extra cost of each drafted token in a verify pass / one-token pass
    draft_cost: float = 0.05  # cost of drafting one token / one target token
    depth_threshold: float = 0.25
    alpha: float = 0.6
    ema_weight: float = 0.3
    fixed_k: int | None = None
    # the ring's time model (module doc); ring_ms 0 keeps the one-box cost model above
    ring_ms: float = 0.0  # a one-token chunk's traversal, send to result
    draft_ms: float = 0.0  # drafting one token on the coordinator
    verify_ms: float = 0.0  # what each extra token of a chunk adds to the traversal
    stage_ms: float = 0.0  # the slowest stage's time for a one-token chunk
    congestion: float = 0.0  # measured slow-down of a traversal per further chunk in flight

    def __post_init__(self) -> None:
        if not (1 <= self.k_min <= self.k_max):
            raise UsageError(f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}")
        if self.max_depth < 1:
            raise UsageError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.fixed_k is not None and self.fixed_k < 1:
            raise UsageError(f"fixed_k must be >= 1, got {self.fixed_k}")
        self._alpha0 = self.alpha  # the acceptance it starts from (a receipt records it)
        for name in ("ring_ms", "draft_ms", "verify_ms", "stage_ms", "congestion", "alpha"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise UsageError(f"{name} must be a finite number >= 0, got {v}")

    def settings(self) -> dict[str, float | int | None]:
        """The constants that fix the schedule (a receipt records them; ``KPolicy(**them)``)."""
        out: dict[str, float | int | None] = {
            "k_min": self.k_min, "k_max": self.k_max, "max_depth": self.max_depth, "fixed_k": self.fixed_k,
            "verify_cost": self.verify_cost, "draft_cost": self.draft_cost,
        }  # fmt: skip
        if self.ring_ms > 0:
            out |= {"ring_ms": self.ring_ms, "draft_ms": self.draft_ms, "verify_ms": self.verify_ms,
                    "stage_ms": self.stage_ms, "congestion": self.congestion, "alpha": self._alpha0}  # fmt: skip
        return out

    def update(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            rate = accepted / proposed
            self.alpha = (1 - self.ema_weight) * self.alpha + self.ema_weight * rate

    def next_k(self) -> int:
        if self.ring_ms > 0:
            return self.plan()[0]
        if self.fixed_k is not None:
            return self.fixed_k
        a = min(self.alpha, 0.999)
        best_k, best = self.k_min, -1.0
        for k in range(self.k_min, self.k_max + 1):
            gain = (1 - a ** (k + 1)) / (1 - a)
            # with several chunks in flight, chunk j only counts if the j-1 before it were
            # accepted whole (alpha^K each): deep pipelines favour shorter chunks
            gain *= sum(a ** (k * j) for j in range(self.max_depth))
            value = gain / (1 + (self.verify_cost + self.draft_cost) * k)
            if value > best + 1e-12:
                best_k, best = k, value
        return best_k

    def rate(self, k: int, d: int, alpha: float | None = None) -> float:
        """Expected tokens per ms of K drafts with d chunks in flight (the ring's time model)."""
        a = min(self.alpha if alpha is None else alpha, 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a) * sum(a ** (k * j) for j in range(d))
        cycle = max(
            (self.ring_ms + k * (self.verify_ms + self.draft_ms)) * (1 + self.congestion * (d - 1)),
            d * k * self.draft_ms,
            d * self.stage_ms * (1 + self.verify_cost * k),
        )
        return tokens / cycle if cycle > 0 else math.inf

    def plan(self, alpha: float | None = None) -> tuple[int, int]:
        """(K, depth) of the ring's time model; see the module doc."""
        ks = [self.fixed_k] if self.fixed_k is not None else range(self.k_min, self.k_max + 1)
        best_k, best_d, best = self.k_min, 1, -1.0
        for k in ks:
            d, v = self._best_depth(k, alpha)
            if v > best * 1.01:
                best_k, best_d, best = k, d, v
        return best_k, best_d

    def _best_depth(self, k: int, alpha: float | None = None) -> tuple[int, float]:
        best_d, best = 1, -1.0
        for d in range(1, self.max_depth + 1):
            v = self.rate(k, d, alpha)
            if v > best * 1.01:
                best_d, best = d, v
        return best_d, best

    def choose(self) -> tuple[int, int]:
        """K and the depth in flight for the next chunks."""
        if self.ring_ms > 0:
            return self.plan()
        k = self.next_k()
        return k, self.depth(k)

    def depth(self, k: int) -> int:
        if self.ring_ms > 0:
            return self._best_depth(k)[0]
        d = 1
        for level in range(1, self.max_depth):
            if self.alpha ** (k * level) >= self.depth_threshold:
                d += 1
        return d
