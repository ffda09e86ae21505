"""K and the depth on a ring: the time model, its recorded constants, and drafting chunk by chunk."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from swarm.errors import UsageError
from swarm.model.kpolicy import KPolicy
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import Draft, SpeculativeDecoder

WAN = dict(ring_ms=150.0, stage_ms=15.0, verify_ms=3.0, max_depth=4)


def ring(draft_ms: float, alpha: float, **kw: float) -> KPolicy:
    p = KPolicy(**{**WAN, **kw}, draft_ms=draft_ms)  # type: ignore[arg-type]
    p.alpha = alpha
    return p


def test_a_slow_ring_keeps_chunks_in_flight_and_a_fast_one_does_not() -> None:
    k, d = ring(20.0, 0.95).plan()
    assert d == 4 and k >= 2  # 150 ms of latency: fill the pipeline
    fast = ring(20.0, 0.95, ring_ms=5.0, stage_ms=1.0, verify_ms=0.1)
    k_fast, d_fast = fast.plan()
    assert k_fast == 1  # the draft costs more than a traversal: as little drafting as can be ...
    assert fast.rate(k_fast, d_fast) < 1 / 5.0  # ... and still slower than a token per traversal


def test_acceptance_and_draft_cost_steer_k() -> None:
    assert ring(2.0, 0.95).plan()[0] > ring(2.0, 0.3).plan()[0]  # a good draft drafts further
    assert ring(2.0, 0.9).plan()[0] >= ring(60.0, 0.9).plan()[0]  # an expensive one less far
    # the draft's own time bounds what a deep pipeline gains: d chunks need d K draft_ms
    slow = ring(100.0, 0.95)
    k, d = slow.plan()
    assert d * k * 100.0 <= 2 * (150.0 + k * 103.0)


def test_rate_is_what_plan_maximises() -> None:
    p = ring(20.0, 0.8)
    k, d = p.plan()
    best = max(p.rate(kk, dd) for kk in range(1, 9) for dd in range(1, 5))
    assert p.rate(k, d) >= best / 1.01**2  # within the 1 % steps a bigger K or d must win by
    assert p.choose() == (k, d) == (p.next_k(), p.depth(k))


def test_recorded_settings_replay_the_same_schedule() -> None:
    p = ring(17.25, 0.6, ring_ms=123.456789)
    again = KPolicy(**p.settings())  # type: ignore[arg-type]
    for acc in ([3, 3, 2], [0, 1], [4, 4, 4, 4]):
        for a in acc:
            p.update(4, a)
            again.update(4, a)
        assert p.choose() == again.choose()
    assert "ring_ms" not in KPolicy(max_depth=2).settings()  # the one-box model records no ring


def test_bad_constants_are_refused() -> None:
    with pytest.raises(UsageError, match="draft_ms"):
        KPolicy(draft_ms=-1.0)
    with pytest.raises(UsageError, match="ring_ms"):
        KPolicy(ring_ms=float("nan"))


class Counting:
    """A deterministic drafter that records its calls (and whether prepare came first)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def prepare(self, prompt: Sequence[int]) -> None:
        self.calls.append(("prepare", len(prompt)))

    def propose(self, context: Sequence[int], k: int, params: SamplingParams) -> Draft:
        self.calls.append(("propose", len(context)))
        return Draft([(context[-1] + 1 + i) % 7 for i in range(k)], None)


def test_poll_iter_is_poll_one_chunk_at_a_time() -> None:
    def run(chunked: bool) -> tuple[list[tuple[int, tuple[int, ...]]], list[tuple[str, int]]]:
        d = Counting()
        dec = SpeculativeDecoder([1, 2, 3, 4, 5], params=SamplingParams(), max_new_tokens=20, drafter=d,
                                 policy=KPolicy(max_depth=3, depth_threshold=0.0, fixed_k=2), prefill_chunk=2)  # fmt: skip
        import torch

        issued: list[tuple[int, tuple[int, ...]]] = []
        while not dec.done:
            chunks = []
            if chunked:
                for c in dec.poll_iter():  # a ring sends each as it comes
                    chunks.append(c)
            else:
                chunks = dec.poll()
            issued += [(c.base, c.tokens) for c in chunks]
            for c in chunks:
                if dec.is_live(c.chunk_id):
                    logits = torch.zeros(c.n_rows, 7)
                    logits[:, 3] = 1.0  # the target always says 3: most drafts are rejected
                    dec.feed(c.chunk_id, logits)
        return issued, d.calls

    a, b = run(True), run(False)
    assert a == b
    assert b[1][0] == ("prepare", 5) and [k for k, _ in b[1]].count("prepare") == 1
