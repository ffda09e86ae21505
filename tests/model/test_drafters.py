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


def test_prepare_early_or_late_gives_the_same_drafts_in_bf16(tiny: Path) -> None:
    """A ring's coordinator runs the prompt into the draft cache while the ring prefills; the
    one-box reference lets the decoder do it before the first proposal: the same forwards, so the
    same bf16 drafts."""
    from swarm.model.drafters import DraftModel
    from swarm.model.speculative import KPolicy, SpeculativeDecoder

    proto = ModelDrafter.load(tiny, dtype=torch.bfloat16, max_len=64)
    model = DraftModel(proto.head, proto.stages, name="tiny")
    prompt = [3, 17, 42, 9, 11, 5]
    drafts = []
    for early in (True, False):
        d = model.drafter(64)
        dec = SpeculativeDecoder(prompt, params=GREEDY, max_new_tokens=12, drafter=d, policy=KPolicy(fixed_k=3, max_depth=3,
                                 depth_threshold=0.0), prefill_chunk=4)  # fmt: skip
        chunks = dec.poll()  # the prefill pieces
        if early:
            dec.prepare_drafter()
            assert d.tokens_run == len(prompt) - 1 and d.forwards == 0  # the prompt's forward is not a proposal's
        logits = torch.zeros(1, 128)
        logits[0, 7] = 1.0
        dec.feed(chunks[0].chunk_id, torch.zeros(0, 128))
        dec.feed(chunks[1].chunk_id, logits)
        drafts.append([c.tokens for c in dec.poll()])
        # the prompt, the pending 7, and every draft of the 3 chunks but the last one (drafts ahead)
        assert d.tokens_run == len(prompt) + 1 + 3 * 3 - 1
        d.close()
        assert all(d.session not in st.sessions() for st in model.stages)  # its KV cache is freed
    assert drafts[0] == drafts[1] and len(drafts[0]) == 3


def test_drafters_of_one_model_keep_their_own_caches(tiny: Path) -> None:
    from swarm.model.drafters import DraftModel

    proto = ModelDrafter.load(tiny, dtype=torch.float32, max_len=64)
    model = DraftModel(proto.head, proto.stages, name="tiny")
    a, b = model.drafter(64), model.drafter(64)
    ctx_a, ctx_b = [3, 17, 42, 9], [100, 2, 77]
    alone_a = model.drafter(64).propose(ctx_a, 4, GREEDY).tokens
    alone_b = model.drafter(64).propose(ctx_b, 4, GREEDY).tokens
    assert a.propose(ctx_a, 2, GREEDY).tokens == alone_a[:2]
    assert b.propose(ctx_b, 4, GREEDY).tokens == alone_b
    assert a.propose(ctx_a + alone_a[:2], 2, GREEDY).tokens == alone_a[2:]  # drafts on from its own cache
    assert a.forwards == 4 and a.tokens_run == len(ctx_a) + 3  # the second call ran only the new tokens
    a.close()
    assert a.propose(ctx_a, 2, GREEDY).tokens == []  # a closed drafter proposes nothing
