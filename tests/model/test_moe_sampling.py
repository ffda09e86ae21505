"""Speculative sampling keeps the target's distribution on a real MoE family: the chi-square
check of test_speculative.py (its helpers, reused) with a tiny Qwen3-MoE checkpoint written by
transformers as the target (vocabulary cut to 4 tokens, so the joint law of 3 new tokens has 64
cells), run through our Head and Stages (transformers' MoE layers, experts routed per token)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from swarm.model.generate import LocalModel
from swarm.model.sampling import SamplingParams, target_probs
from swarm.model.speculative import VerifyChunk
from swarm.testing.hf_checkpoints import write_family_checkpoint
from tests.model.test_speculative import (
    N_NEW,
    N_RUNS,
    CyclingDrafter,
    TableDrafter,
    V,
    chi2_tv,
    empirical,
    exact_joint,
)

torch.set_num_threads(1)


class MoETarget:
    """The interface test_speculative's helpers drive (execute a chunk; logits after a prefix)."""

    def __init__(self, model: LocalModel) -> None:
        self.model = model
        self.session = model.open_session(32)
        self._after: dict[tuple[int, ...], torch.Tensor] = {}
        # the tiny model's logits span tens of units (peaky: one cell would hold most of the law);
        # sampling at their own spread gives a 64-cell law where every cell can be tested
        self.temperature = float(torch.stack([self.logits_for([0, t]) for t in range(V)]).std())

    def execute(self, chunk: VerifyChunk) -> torch.Tensor:
        return self.model.run_chunk(self.session, chunk)

    def logits_for(self, prefix: Sequence[int]) -> torch.Tensor:
        key = tuple(prefix)
        if key not in self._after:
            s = self.model.open_session(32)
            try:
                chunk = VerifyChunk(chunk_id=0, base=0, tokens=list(prefix), logits_from=len(prefix) - 1, prefill=True)
                self._after[key] = self.model.run_chunk(s, chunk)[-1]
            finally:
                self.model.close_session(s)
        return self._after[key]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> MoETarget:
    d = write_family_checkpoint(tmp_path_factory.mktemp("moe-sampling") / "m", "qwen3_moe", seed=7, vocab_size=V,
                                bos_token_id=1, pad_token_id=0)  # fmt: skip
    return MoETarget(LocalModel.load(d, stages=[(0, 1), (1, 3)], dtype=torch.float32))


@pytest.mark.slow  # long-running: out of `make check`, still in `make test`
@pytest.mark.parametrize("kind", ["model-draft", "deterministic-draft"])
def test_rejection_sampling_keeps_a_moe_target_distribution(kind: str, target: MoETarget) -> None:
    def params_of(run: int) -> SamplingParams:
        return SamplingParams(temperature=target.temperature, seed=run)


    exact = exact_joint(target, [0, 1], params_of(0))  # type: ignore[arg-type]
    assert len(exact) == V**N_NEW and abs(sum(exact.values()) - 1) < 1e-4
    assert max(exact.values()) < 0.5  # not a near-deterministic law: the check has power
    drafter = CyclingDrafter(V) if kind == "deterministic-draft" else TableDrafter(V, seed=5, scale=1.0)
    counts = empirical(target, drafter, params_of, k=2, n_runs=N_RUNS // 2)  # type: ignore[arg-type]
    chi2, tv = chi2_tv(counts, exact)
    # 64 cells -> 63 degrees of freedom; the 0.999 quantile of chi2(63) is about 103.4.
    assert chi2 < 103.4, (chi2, tv)
    assert tv < 0.05, tv
    if kind == "model-draft":  # negative control: the drafter's own law is rejected by the same statistic
        wrong = empirical(_DraftAsTarget(drafter), None, params_of, k=2, n_runs=N_RUNS // 10)  # type: ignore[arg-type]
        assert chi2_tv(wrong, exact)[0] > 300


class _DraftAsTarget:
    """The table drafter's logits served as if they were the target's."""

    def __init__(self, drafter: TableDrafter) -> None:
        self.table, self.cache = drafter.table, []  # type: ignore[var-annotated]

    def execute(self, chunk: VerifyChunk) -> torch.Tensor:
        del self.cache[chunk.base:]
        rows = []
        for i, tok in enumerate(chunk.tokens):
            self.cache.append(tok)
            if i >= chunk.logits_from:
                rows.append(self.table[self.cache[-2] if len(self.cache) >= 2 else 0, self.cache[-1]])
        return torch.stack(rows)


def test_the_moe_target_is_not_uniform(target: MoETarget) -> None:
    p = target_probs(target.logits_for([0, 1]), SamplingParams(temperature=target.temperature, seed=0))
    assert float(p.max() - p.min()) > 0.05, p
