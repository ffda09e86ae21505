"""Sampling: the target distribution, seeded reproducibility, bad parameters."""

from __future__ import annotations

import pytest
import torch

from swarm.errors import UsageError
from swarm.model.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingParams,
    position_generator,
    sample_token,
    target_probs,
)

torch.set_num_threads(1)  # the test machine is shared: more threads than cores is far slower


def test_greedy_is_one_hot_at_first_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 0.0, 0.0]])
    p = target_probs(logits, SamplingParams())
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert sample_token(logits[0], SamplingParams(), position=7) == 1


def test_temperature_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = target_probs(logits, SamplingParams(temperature=1.0, seed=1))
    assert torch.allclose(p, torch.tensor([0.5, 0.25, 0.15, 0.1]), atol=1e-6)
    # top_k 2 keeps the two largest, renormalized.
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]), atol=1e-6)
    # top_p 0.7: 0.5 alone is short of 0.7, so 0.25 joins; 0.15 is dropped (0.75 >= 0.7).
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]), atol=1e-6)
    # top_p that a single token already covers keeps exactly that token.
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.4))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]
    # Temperature 2 flattens: p ∝ sqrt(p0).
    p = target_probs(logits, SamplingParams(temperature=2.0))
    ref = torch.sqrt(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(p, ref / ref.sum(), atol=1e-6)


def test_batched_rows_match_single_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    batch = target_probs(logits, params)
    for i in range(5):
        assert torch.equal(batch[i], target_probs(logits[i], params))


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1000)
    a = [sample_token(logits, SamplingParams(temperature=1.0, seed=5), position=i) for i in range(40)]
    b = [sample_token(logits, SamplingParams(temperature=1.0, seed=5), position=i) for i in range(40)]
    c = [sample_token(logits, SamplingParams(temperature=1.0, seed=6), position=i) for i in range(40)]
    assert a == b
    assert a != c
    g1 = position_generator(3, 10, STREAM_SAMPLE)
    g2 = position_generator(3, 10, STREAM_ACCEPT)
    assert torch.rand(4, generator=g1).tolist() != torch.rand(4, generator=g2).tolist()


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    params = SamplingParams(temperature=1.0, seed=11)
    n = 6000
    counts = torch.zeros(3)
    for i in range(n):
        counts[sample_token(logits, params, position=i)] += 1
    assert torch.allclose(counts / n, torch.tensor([0.6, 0.3, 0.1]), atol=0.025)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1.0}, {"temperature": float("nan")}, {"top_k": -2}, {"top_p": 0.0},
     {"top_p": 1.5}, {"seed": -1}],
)
def test_bad_params_are_usage_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(UsageError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
