"""GGUF files of every supported GGUF architecture, split sets, and the tokenizer a GGUF carries.

The files are written by the ``gguf`` package the way llama.cpp's converter writes them
(swarm/testing/gguf_files.py: its own tensor-name map, stacked experts, permuted Q/K, Gemma's
1 + w norms) from tiny transformers checkpoints, and every split of our stages over the GGUF must
give transformers' greedy tokens on the original checkpoint (fp32). Sliding windows are turned
off where llama.cpp's format has no key for them (Mistral, Mixtral, Qwen2/3 and Qwen3-MoE); Gemma 3
keeps llama.cpp's 5:1 pattern, so its model has 6 layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from swarm.errors import ConfigError, TokenizerError, WeightsError
from swarm.model.bundled import bundled_gguf_path, default_model_dir
from swarm.model.generate import LocalModel, generate
from swarm.model.gguf import GGUFSource, config_from_gguf, split_files
from swarm.model.quant import QuantExperts
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import open_checkpoint
from swarm.testing.checkpoints import contiguous_splits
from swarm.testing.gguf_files import write_family_gguf
from swarm.testing.hf_checkpoints import write_family_checkpoint

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

PROMPT = [1, 5, 9, 33, 7, 100, 3, 44, 12, 19, 200, 150]
NEW = 10
FAMILIES: dict[str, dict[str, object]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "mixtral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False},
    "qwen3_moe": {"use_sliding_window": False},
    "gemma2": {},
    "gemma3": {"layer_types": None, "num_hidden_layers": 6},
    "phi3": {},
}
SEEDS = {"gemma2": 3}
ARCH = {"mistral": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-families")


def _hf(root: Path, family: str) -> Path:
    d = root / f"hf-{family}"
    if not d.exists():
        write_family_checkpoint(d, family, seed=SEEDS.get(family, 1), **FAMILIES[family])  # type: ignore[arg-type]
    return d


def _reference(d: Path) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.int64),
                             max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_split_of_a_gguf_matches_transformers(family: str, root: Path) -> None:
    hf = _hf(root, family)
    path = write_family_gguf(hf, root / f"{family}.gguf")
    ref = _reference(hf)
    assert len(set(ref)) > 3, ref
    ck = open_checkpoint(path)
    hf_cfg = json.loads((hf / "config.json").read_text())
    assert ck.args.config["architectures"] == [ARCH.get(family, hf_cfg["architectures"][0])]
    n = ck.args.n_layers
    splits = contiguous_splits(n) if n <= 3 else [[(0, n)], [(0, 2), (2, 5), (5, 6)]]
    for blocks in splits:
        got = generate(LocalModel.load(ck, stages=blocks, dtype=torch.float32), PROMPT, max_new_tokens=NEW,
                       eos_token_ids=()).output_token_ids  # fmt: skip
        assert got == ref, (family, blocks)


def test_a_split_gguf_loads_as_one(root: Path) -> None:
    hf = _hf(root, "qwen3_moe")
    whole = GGUFSource(write_family_gguf(hf, root / "whole.gguf"))
    first = write_family_gguf(hf, root / "parts.gguf", split=3)
    files = split_files(first)
    assert [f.name for f in files] == [f"parts-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for given in files:  # any split names the set
        src = GGUFSource(given)
        assert len(src.files) == 3 and sorted(src.names()) == sorted(whole.names())
        assert config_from_gguf(given) == config_from_gguf(whole.path)
    assert {len(f.tensors) for f in src.files} != {0}  # the tensors really are spread out
    for name in whole.names():
        assert torch.equal(src.load(name, torch.float32), whole.load(name, torch.float32)), name
    ref = _reference(hf)
    assert generate(LocalModel.load(first, stages=[(0, 1), (1, 3)], dtype=torch.float32), PROMPT,
                    max_new_tokens=NEW, eos_token_ids=()).output_token_ids == ref  # fmt: skip
    gone = root / "gone"
    gone.mkdir()
    for f in files[:2]:
        shutil.copy(f, gone / f.name)
    with pytest.raises(WeightsError, match="parts-00003-of-00003.gguf \\(of 3\\) is missing"):
        GGUFSource(gone / files[0].name)
    shutil.copy(files[1], gone / files[2].name)  # split 2's file under split 3's name
    with pytest.raises(WeightsError, match="its metadata says split 1 of 3, its name split 2 of 3"):
        GGUFSource(gone / files[0].name)


def test_stacked_gguf_experts_are_sliced_per_expert_and_kept_compact(root: Path) -> None:
    """Q4_0 experts: each expert's rows dequantized on their own; then int4 in every split."""
    hf = _hf(root, "mixtral")
    path = write_family_gguf(hf, root / "mixtral-q4.gguf", qtype=gguf.GGMLQuantizationType.Q4_0)
    src = GGUFSource(path)
    assert src.gguf_type("model.layers.1.block_sparse_moe.experts.2.w1.weight") == "Q4_0"
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        want = f.get_tensor("model.layers.1.block_sparse_moe.experts.2.w1.weight")
    got = src.load("model.layers.1.block_sparse_moe.experts.2.w1.weight", torch.float32)
    assert got.shape == want.shape and float((got - want).norm() / want.norm()) < 0.15
    one = LocalModel.load(path, stages=1, dtype=torch.float32, quant="int4")
    assert any(isinstance(m, QuantExperts) for m in one.stages[0].modules())
    want_ids = generate(one, PROMPT, max_new_tokens=NEW, eos_token_ids=()).output_token_ids
    for blocks in contiguous_splits(3)[1:]:
        model = LocalModel.load(path, stages=blocks, dtype=torch.float32, quant="int4")
        assert generate(model, PROMPT, max_new_tokens=NEW, eos_token_ids=()).output_token_ids == want_ids


def test_unsupported_gguf_features_are_named(root: Path, tmp_path: Path) -> None:
    hf = _hf(root, "phi3")
    w = gguf.GGUFWriter(str(tmp_path / "long.gguf"), arch="phi3")
    src = GGUFSource(write_family_gguf(hf, root / "phi3-plain.gguf"))
    for k, v in src.file.metadata.items():
        if k.startswith("phi3.") and isinstance(v, int):
            w.add_uint32(k, v)
        elif k.startswith("phi3.") and isinstance(v, float):
            w.add_float32(k, v)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    w.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="rope_factors_long.weight"):
        config_from_gguf(tmp_path / "long.gguf")


# ---------------------------------------------------------------------------------- tokenizer


def test_the_bundled_gguf_tokenizer_is_the_converted_one() -> None:
    from_file = Tokenizer.from_gguf(bundled_gguf_path())
    converted = Tokenizer.from_dir(default_model_dir())
    for text in ["Hello, world! 2024 has 366 days", "  spaces\tand\nlines", "<|im_start|>user\nhi<|im_end|>",
                 "Ünïcödé 日本語 🤖", "def f(x):\n    return x ** 2\n"]:  # fmt: skip
        assert from_file.encode(text) == converted.encode(text), text
        assert from_file.decode(from_file.encode(text), skip_special_tokens=False) == text
    assert from_file.eos_token_ids == converted.eos_token_ids == (2,)
    assert from_file.bos_token_id == 1 and from_file.chat_template == converted.chat_template
    assert from_file.encode("12345") == [33, 34, 35, 36, 37]  # SmolLM splits digits


def _sentencepiece_gguf(path: Path, model: str = "llama") -> Path:
    """A tiny SentencePiece vocabulary as llama.cpp stores one: pieces, scores, byte fallback."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "lo", "▁hel", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = pieces + words
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(pieces) + [-float(i) for i in range(len(words))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(words))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_sentencepiece_gguf_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = Tokenizer.from_gguf(_sentencepiece_gguf(tmp_path / "sp.gguf"))
    ids = tok.encode("hello world")
    assert [tok._tok.id_to_token(i) for i in ids] == ["▁hello", "▁world"]
    assert tok.decode(ids) == "hello world"
    assert tok.encode("hello world", add_special_tokens=True) == [1, *ids]  # the file's add_bos_token
    assert tok.decode(tok.encode("hé")) == "hé"  # é through byte fallback
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    # Tokenizer.load converts once into the cache and reads the converted files back
    monkeypatch.setenv("SHARD_SWARM_CACHE", str(tmp_path / "cache"))
    first = Tokenizer.load(tmp_path / "sp.gguf")
    kept = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(kept) == 1 and (kept[0] / "tokenizer.json").is_file()
    again = Tokenizer.load(tmp_path / "sp.gguf")
    assert again.where == str(kept[0])
    assert again.encode("hello world", add_special_tokens=True) == first.encode("hello world", add_special_tokens=True)
    assert again.eos_token_ids == (2,) and again.bos_token_id == 1


def test_a_gguf_tokenizer_we_cannot_build_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"mystery\.gguf: cannot build the tokenizer.*'mystery'"):
        Tokenizer.from_gguf(_sentencepiece_gguf(tmp_path / "mystery.gguf", model="mystery"))
