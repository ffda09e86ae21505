"""Draft models by name: specs, the memory each needs, loading, and the vocabulary check both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch

from swarm.errors import ConfigError, UsageError
from swarm.model.drafters import CompactHead, ModelDrafter
from swarm.model.draftload import (
    AUTO_MODEL,
    check_vocabularies,
    draft_weight_bytes,
    load_draft_model,
    parse_draft,
)
from swarm.model.sampling import SamplingParams
from swarm.model.stage import Head
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import open_checkpoint
from swarm.testing.checkpoints import TinySpec, write_checkpoint

torch.set_num_threads(1)

TOKENS = [f"t{i}" for i in range(60)]


def write_tokenizer(d: Path, tokens: list[str]) -> Path:
    """A word-level tokenizer.json whose id i is ``tokens[i]``."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({}))
    return d


def tok_of(d: Path, tokens: list[str]) -> Tokenizer:
    return Tokenizer.from_dir(write_tokenizer(d, tokens))


def test_parse_draft() -> None:
    assert parse_draft("int4").kind == "int4" and not parse_draft("int4").auto
    auto = parse_draft("auto")
    assert auto.auto and auto.kind == AUTO_MODEL and str(auto) == f"auto:{AUTO_MODEL}"
    assert parse_draft("auto:self").kind == "self" and parse_draft("auto:self").auto
    assert not parse_draft("ngram").model and parse_draft("self").model
    with pytest.raises(UsageError, match="not none, ngram"):
        parse_draft("/no/such/draft")
    with pytest.raises(UsageError, match="auto:SPEC"):
        parse_draft("auto:ngram")


def test_same_tokenizer_with_padding_rows_either_way_is_accepted(tmp_path: Path) -> None:
    t, d = tok_of(tmp_path / "t", TOKENS), tok_of(tmp_path / "d", TOKENS)
    # the head rows past the tokenizer's 60 tokens are padding: the draft may have fewer (or more)
    check_vocabularies(t, d, target_rows=64, draft_rows=60)
    check_vocabularies(t, d, target_rows=60, draft_rows=64)


def test_a_differing_token_is_refused_naming_the_first(tmp_path: Path) -> None:
    other = list(TOKENS)
    other[17], other[40] = "zz", "yy"
    t, d = tok_of(tmp_path / "t", TOKENS), tok_of(tmp_path / "d", other)
    with pytest.raises(ConfigError, match=r"token id 17 is 'zz' in the draft's vocabulary but 't17' in the target's"):
        check_vocabularies(t, d, target_rows=60, draft_rows=60, draft_name="tiny-draft")


def test_missing_or_extra_tokens_are_refused(tmp_path: Path) -> None:
    t, short = tok_of(tmp_path / "t", TOKENS), tok_of(tmp_path / "s", TOKENS[:50])
    with pytest.raises(ConfigError, match="token id 50 is no token in the draft's vocabulary but 't50'"):
        check_vocabularies(t, short, target_rows=60, draft_rows=60)
    with pytest.raises(ConfigError, match="token id 50 is 't50' in the draft's vocabulary but no token"):
        check_vocabularies(short, t, target_rows=60, draft_rows=60)
    with pytest.raises(ConfigError, match="LM head has 40 rows but the tokenizer has 60 tokens"):
        check_vocabularies(t, tok_of(tmp_path / "d", TOKENS), target_rows=60, draft_rows=40)
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        check_vocabularies(t, None, target_rows=60, draft_rows=60)
    check_vocabularies(None, None, target_rows=60, draft_rows=60)  # prompts as ids: the sizes must agree
    with pytest.raises(ConfigError, match="vocabulary of 64 tokens but the target has 60"):
        check_vocabularies(None, None, target_rows=60, draft_rows=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A target with 64 head rows, a draft with 60 (the target minus padding rows) sharing its
    60-token tokenizer, and a draft whose tokenizer differs."""
    root = tmp_path_factory.mktemp("pair")
    target = write_checkpoint(root / "target", TinySpec(n_layers=4, vocab_size=64), seed=1)
    draft = write_checkpoint(root / "draft", TinySpec(n_layers=2, vocab_size=60), seed=2)
    alien = write_checkpoint(root / "alien", TinySpec(n_layers=2, vocab_size=64), seed=3)
    write_tokenizer(target, TOKENS)
    write_tokenizer(draft, TOKENS)
    write_tokenizer(alien, ["x" + t for t in TOKENS])
    return target, draft, alien


def test_a_checkpoint_draft_with_fewer_rows_drafts_over_the_targets_ids(pair: tuple[Path, Path, Path]) -> None:
    target, draft, _ = pair
    ckpt = open_checkpoint(target)
    head = Head.load(ckpt.args, ckpt.source, dtype=torch.float32)
    dm = load_draft_model(parse_draft(str(draft)), head=head, target=ckpt, dtype=torch.float32, device="cpu",
                          target_tokenizer=Tokenizer.from_dir(target))  # fmt: skip
    assert dm.vocab == 60 and dm.target_vocab == 64
    d = dm.drafter(32)
    sampled = d.propose([1, 2, 3], 3, SamplingParams(temperature=1.0, seed=4))
    assert sampled.probs is not None and sampled.probs.shape == (3, 64)
    assert float(sampled.probs[:, 60:].abs().sum()) == 0.0  # ids the draft cannot propose: probability 0
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(3), atol=1e-5)
    assert all(t < 60 for t in sampled.tokens + d.propose([1, 2, 3], 4, SamplingParams()).tokens)
    assert dm.nbytes() == draft_weight_bytes(parse_draft(str(draft)), ckpt.args, 4)[0]


def test_a_checkpoint_draft_with_another_tokenizer_is_refused(pair: tuple[Path, Path, Path]) -> None:
    target, _, alien = pair
    ckpt = open_checkpoint(target)
    head = Head.load(ckpt.args, ckpt.source, dtype=torch.float32)
    with pytest.raises(ConfigError, match="token id 0 is 'xt0' in the draft's vocabulary but 't0'"):
        load_draft_model(parse_draft(str(alien)), head=head, target=ckpt, dtype=torch.float32, device="cpu",
                         target_tokenizer=Tokenizer.from_dir(target))  # fmt: skip


@pytest.mark.parametrize("kind", ["self", "int8", "int4"])
def test_derived_drafts_need_what_the_planner_budgets(tmp_path: Path, kind: str) -> None:
    target = write_checkpoint(tmp_path / "t", TinySpec(n_layers=10, dim=64, vocab_size=96), seed=6)
    ckpt = open_checkpoint(target)
    head = Head.load(ckpt.args, ckpt.source, dtype=torch.bfloat16)
    dm = load_draft_model(parse_draft(kind), head=head, target=ckpt, dtype=torch.bfloat16, device="cpu")
    weights, kv = draft_weight_bytes(parse_draft(kind), ckpt.args, 2)
    assert dm.nbytes() == weights
    assert kv == dm.kv_bytes_per_token() > 0
    assert isinstance(dm.head, CompactHead) == (kind != "self")
    d = dm.drafter(64)
    assert isinstance(d, ModelDrafter) and len(d.propose([5, 6, 7], 3, SamplingParams()).tokens) == 3
    if kind != "self":  # the compact head picks the same drafts as the dense one, near enough
        h = torch.randn(4, 64, dtype=torch.bfloat16)
        dense, compact = head.logits(h), dm.head.logits(h)
        assert (dense.argmax(-1) == compact.argmax(-1)).float().mean() >= 0.75
