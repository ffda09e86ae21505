"""In-process generation over N stages: plain, speculative (any drafter) and sampled."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from swarm.errors import ModelError, UsageError
from swarm.model.drafters import ModelDrafter, NgramDrafter, self_drafter
from swarm.model.generate import LocalModel, generate, split_layers
from swarm.model.sampling import SamplingParams
from swarm.model.speculative import Draft, KPolicy
from swarm.model.stage import Stage
from swarm.testing.checkpoints import TinySpec, write_checkpoint

torch.set_num_threads(1)  # the test machine is shared: more threads than cores is far slower

SPEC = TinySpec(family="llama", n_layers=4, vocab_size=128)
PROMPT = [5, 9, 33, 2, 71, 5, 9, 33, 100, 4, 17]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("target"), SPEC, seed=11)


@pytest.fixture(scope="module")
def model(target_dir: Path) -> LocalModel:
    return LocalModel.load(target_dir, stages=1, dtype=torch.float32)


class BadDrafter:
    def propose(self, context: Sequence[int], k: int, params: SamplingParams) -> Draft:
        return Draft([(context[-1] * 7 + i) % 128 for i in range(k)], None)


def naive_greedy(model: LocalModel, prompt: list[int], n: int) -> list[int]:
    """No cache reuse: recompute the whole sequence on a fresh session for every token."""
    ids = list(prompt)
    for _ in range(n):
        stage = Stage.load(model.args, model.ckpt.source, 0, model.args.n_layers, dtype=torch.float32)
        stage.open_session("n", len(ids))
        h = stage.forward("n", model.head.embed(torch.tensor(ids)))
        ids.append(int(model.head.logits(h[-1:])[0].argmax()))
    return ids[len(prompt):]


def test_split_layers() -> None:
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for bad in (0, 5):
        with pytest.raises(UsageError):
            split_layers(4, bad)


def test_plain_greedy_matches_naive_and_any_split(model: LocalModel, target_dir: Path) -> None:
    ref = generate(model, PROMPT, max_new_tokens=24, prefill_chunk=4)
    assert ref.output_token_ids == naive_greedy(model, PROMPT, 24)
    assert len(set(ref.output_token_ids)) > 3  # not a degenerate constant output
    for n in (2, 4):
        split = LocalModel.load(target_dir, stages=n, dtype=torch.float32)
        assert split.blocks == split_layers(4, n)
        out = generate(split, PROMPT, max_new_tokens=24, prefill_chunk=5)
        assert out.output_token_ids == ref.output_token_ids
    assert ref.tokens_per_s > 0 and ref.accepted_per_round is None
    assert ref.chunks[:3] == [(0, 4), (4, 4), (8, 3)]  # prefill pieces, then one token at a time
    assert all(t == 1 for _, t in ref.chunks[3:])


def test_greedy_with_any_drafter_equals_plain(model: LocalModel, target_dir: Path,
                                              tmp_path: Path) -> None:
    ref = generate(model, PROMPT, max_new_tokens=32).output_token_ids
    other = write_checkpoint(tmp_path / "small", TinySpec(family="llama", n_layers=2, vocab_size=128),
                             seed=99)
    drafters = {
        "ngram": NgramDrafter(),
        "self-target": ModelDrafter.load(target_dir, dtype=torch.float32, max_len=128),
        "other-model": ModelDrafter.load(other, dtype=torch.float32, max_len=128),
        "skip": self_drafter(model.head, model.ckpt, dtype=torch.float32, max_len=128),
        "bad": BadDrafter(),
    }
    split = LocalModel.load(target_dir, stages=3, dtype=torch.float32)
    for name, drafter in drafters.items():
        for policy in (KPolicy(), KPolicy(fixed_k=5)):
            out = generate(split, PROMPT, max_new_tokens=32, drafter=drafter, policy=policy)
            assert out.output_token_ids == ref, name
            assert out.rounds > 0 or name == "ngram"
    exact = generate(model, PROMPT, max_new_tokens=32, drafter=drafters["self-target"],
                     policy=KPolicy(fixed_k=4))
    assert exact.acceptance_rate == 1.0 and exact.accepted_per_round == 4.0
    bad = generate(model, PROMPT, max_new_tokens=32, drafter=BadDrafter(), policy=KPolicy(fixed_k=3))
    assert bad.acceptance_rate is not None and bad.acceptance_rate < 0.5


def test_eos_stops_generation(model: LocalModel) -> None:
    ref = generate(model, PROMPT, max_new_tokens=20).output_token_ids
    eos = ref[6]
    out = generate(model, PROMPT, max_new_tokens=20, eos_token_ids=[eos], drafter=NgramDrafter())
    assert out.output_token_ids == ref[: ref.index(eos) + 1]
    assert out.finish_reason == "eos"


def test_sampling_is_reproducible_by_seed(model: LocalModel, target_dir: Path) -> None:
    def run(seed: int, drafter: object = None) -> list[int]:
        params = SamplingParams(temperature=1.0, top_k=50, seed=seed)
        return generate(model, PROMPT, params=params, max_new_tokens=24,
                        drafter=drafter).output_token_ids  # type: ignore[arg-type]

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    draft = ModelDrafter.load(target_dir, dtype=torch.float32, max_len=128)
    d1, d2 = run(1, draft), run(1, draft)
    assert d1 == d2
    # With the target as its own draft every sampled draft is accepted (p == q).
    params = SamplingParams(temperature=1.0, seed=1)
    out = generate(model, PROMPT, params=params, max_new_tokens=24, drafter=draft,
                   policy=KPolicy(fixed_k=3))
    assert out.acceptance_rate is not None and out.acceptance_rate > 0.95


def test_bad_input(model: LocalModel) -> None:
    with pytest.raises(UsageError, match="outside the vocabulary"):
        generate(model, [1, 500], max_new_tokens=2)
    with pytest.raises(UsageError, match="context window"):
        generate(model, PROMPT, max_new_tokens=10_000)
    with pytest.raises(ModelError):
        LocalModel.load(Path("/nonexistent/model"))


@pytest.mark.slow
def test_bundled_fp32_greedy_with_drafters_equals_plain() -> None:
    from swarm.model.bundled import default_model_dir
    from swarm.model.tokenizer import Tokenizer

    path = default_model_dir()
    tok = Tokenizer.from_dir(path)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colors."}]))
    lm = LocalModel.load(path, stages=2, dtype=torch.float32)
    ref = generate(lm, ids, max_new_tokens=32, eos_token_ids=())
    skip = self_drafter(lm.head, lm.ckpt, dtype=torch.float32, max_len=256)
    for drafter in (NgramDrafter(), skip):
        out = generate(lm, ids, max_new_tokens=32, drafter=drafter, eos_token_ids=())
        assert out.output_token_ids == ref.output_token_ids
    assert tok.decode(ref.output_token_ids).strip()  # real text came out


def test_stages_must_cover_every_layer_once(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "m", TinySpec(n_layers=4), seed=1)
    for blocks in ([(0, 2)], [(0, 2), (3, 4)], [(0, 2), (1, 4)], []):
        with pytest.raises(UsageError, match="contiguous blocks covering layers 0..3"):
            LocalModel.load(ckpt, stages=blocks, dtype=torch.float32)
