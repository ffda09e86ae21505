"""Drafters: n-gram prompt lookup and the model drafter's cache reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.errors import UsageError
from swarm.model.drafters import ModelDrafter, NgramDrafter, self_draft_layers
from swarm.model.sampling import SamplingParams
from swarm.testing.checkpoints import TinySpec, write_checkpoint

torch.set_num_threads(1)  # the test machine is shared: more threads than cores is far slower

GREEDY = SamplingParams()


def test_ngram_prefers_the_longest_most_recent_match() -> None:
    d = NgramDrafter(max_ngram=3)
    # suffix [7, 8, 9] occurred at 0 (followed by 1, 2) and [8, 9] later (followed by 5).
    ctx = [7, 8, 9, 1, 2, 8, 9, 5, 6, 7, 8, 9]
    assert d.propose(ctx, 2, GREEDY).tokens == [1, 2]
    # only a 1-gram match: the most recent earlier "9" is followed by 5, 6, 7
    assert d.propose([9, 5, 6, 7, 3, 9], 3, GREEDY).tokens == [5, 6, 7]
    assert d.propose([1, 2, 3, 4], 4, GREEDY).tokens == []
    assert d.propose([1, 2, 3], 4, GREEDY).probs is None


def test_ngram_continues_a_loop_past_the_end() -> None:
    d = NgramDrafter()
    assert d.propose([5, 1, 2, 1, 2], 5, GREEDY).tokens == [1, 2, 1, 2, 1]
    assert d.propose([4, 4], 3, GREEDY).tokens == [4, 4, 4]


def test_ngram_rejects_bad_sizes() -> None:
    with pytest.raises(UsageError):
        NgramDrafter(max_ngram=1, min_ngram=2)


def test_self_draft_layers_skip_the_middle() -> None:
    assert self_draft_layers(30) == [(0, 12), (18, 30)]
    assert self_draft_layers(4) == [(0, 4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinySpec(family="llama", n_layers=3, vocab_size=128)
    return write_checkpoint(tmp_path_factory.mktemp("draft"), spec, seed=5)


def test_model_drafter_reuses_its_cache_by_common_prefix(tiny: Path) -> None:
    warm = ModelDrafter.load(tiny, dtype=torch.float32, max_len=64)
    ctx = [3, 17, 42, 9]
    first = warm.propose(ctx, 4, GREEDY).tokens
    # Accept two drafts, then a different token: the drafter rolls back to the common prefix.
    ctx2 = ctx + first[:2] + [(first[2] + 1) % 128]
    again = warm.propose(ctx2, 5, GREEDY).tokens
    fresh = ModelDrafter.load(tiny, dtype=torch.float32, max_len=64)
    assert again == fresh.propose(ctx2, 5, GREEDY).tokens
    assert warm.stages[0].session_len(warm.session) == len(ctx2) + 4  # context + k-1 drafts
    # Greedy continuation is self-consistent: proposing from a longer context continues it.
    assert fresh.propose(ctx, 4, GREEDY).tokens[:2] == first[:2]
    assert len(first) == 4 and all(0 <= t < 128 for t in first)


def test_model_drafter_sampling_returns_its_distributions(tiny: Path) -> None:
    d = ModelDrafter.load(tiny, dtype=torch.float32, max_len=64)
    params = SamplingParams(temperature=1.0, seed=3)
    draft = d.propose([1, 2, 3], 3, params)
    assert draft.probs is not None and draft.probs.shape == (3, 128)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(3), atol=1e-5)
    assert all(float(draft.probs[i, t]) > 0 for i, t in enumerate(draft.tokens))
    assert d.propose([1, 2, 3], 3, params).tokens == draft.tokens  # seeded by position
    assert d.propose([1, 2, 3], 0, params).tokens == []
