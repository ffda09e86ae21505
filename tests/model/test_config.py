"""ModelArgs from config.json: the families, the byte counts, and every way a config can be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm.errors import ConfigError
from swarm.model.config import ModelArgs
from swarm.testing.checkpoints import FAMILIES, TinySpec, random_tensors, tiny_config


def test_families_map_to_fields() -> None:
    llama = ModelArgs.from_config(tiny_config(TinySpec(family="llama")))
    assert llama.architecture == "llama"
    assert (llama.n_heads, llama.n_kv_heads, llama.head_dim) == (4, 2, 16)
    assert not llama.tie_word_embeddings and llama.config["rope_scaling"]["rope_type"] == "llama3"

    qwen = ModelArgs.from_config(tiny_config(TinySpec(family="qwen2")))
    assert qwen.architecture == "qwen2" and qwen.sliding_window is None

    smol = ModelArgs.from_config(tiny_config(TinySpec(family="smollm")))
    assert smol.architecture == "llama" and smol.tie_word_embeddings

    mistral = ModelArgs.from_config(tiny_config(TinySpec(family="mistral", head_dim=32)))
    assert mistral.architecture == "mistral" and mistral.head_dim == 32
    assert mistral.sliding_window == 256


def test_eos_and_bos_forms() -> None:
    base = tiny_config(TinySpec())
    assert ModelArgs.from_config({**base, "eos_token_id": 2}).eos_token_ids == (2,)
    assert ModelArgs.from_config({**base, "eos_token_id": [2, 7]}).eos_token_ids == (2, 7)
    assert ModelArgs.from_config({**base, "eos_token_id": None}).eos_token_ids == ()
    with pytest.raises(ConfigError, match="eos_token_id"):
        ModelArgs.from_config({**base, "eos_token_id": "2"})
    with pytest.raises(ConfigError, match="bos_token_id"):
        ModelArgs.from_config({**base, "bos_token_id": 1.5})


def test_defaults_when_optional_fields_absent() -> None:
    cfg = tiny_config(TinySpec(family="llama2", n_kv_heads=4))
    for k in ("num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings"):
        cfg.pop(k)
    a = ModelArgs.from_config(cfg)
    assert a.n_kv_heads == a.n_heads and a.tie_word_embeddings is False


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"architectures": "LlamaForCausalLM"}, "architectures"),
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"num_hidden_layers": "4"}, "num_hidden_layers"),
        ({"vocab_size": True}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ],
)
def test_bad_fields_are_named(change: dict[str, object], field: str) -> None:
    cfg = {**tiny_config(TinySpec(family="llama")), **change}
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_config(cfg, where="/x/config.json")
    assert field in str(e.value) and "/x/config.json" in str(e.value)


def test_missing_field_is_named() -> None:
    cfg = tiny_config(TinySpec())
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match=r"config.json: missing field 'hidden_size'"):
        ModelArgs.from_config(cfg)


def test_model_type_fallback_and_unknown() -> None:
    cfg = tiny_config(TinySpec(family="qwen2"))
    del cfg["architectures"]
    assert ModelArgs.from_config(cfg).architecture == "qwen2"
    cfg["model_type"] = "gpt_neox"
    with pytest.raises(ConfigError, match="model_type='gpt_neox'"):
        ModelArgs.from_config(cfg)
    with pytest.raises(ConfigError, match="JSON object"):
        ModelArgs.from_config([1, 2])  # type: ignore[arg-type]


def test_from_dir_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json: not found"):
        ModelArgs.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(TinySpec(family="smollm"))))
    assert ModelArgs.from_dir(tmp_path).tie_word_embeddings


@pytest.mark.parametrize("family", FAMILIES)
def test_byte_counts_match_real_tensors(family: str) -> None:
    spec = TinySpec(family=family, n_layers=2, head_dim=24 if family == "mistral" else None)
    args = ModelArgs.from_config(tiny_config(spec))
    tensors = random_tensors(spec, seed=0)
    for dtype_bytes in (2, 4):
        layer0 = sum(t.numel() for k, t in tensors.items() if k.startswith("model.layers.0."))
        assert args.layer_bytes(dtype_bytes) == layer0 * dtype_bytes
        head = sum(t.numel() for k, t in tensors.items() if not k.startswith("model.layers."))
        assert args.head_bytes(dtype_bytes) == head * dtype_bytes
        kv = 2 * args.n_kv_heads * args.head_dim * dtype_bytes
        assert args.kv_bytes_per_token_per_layer(dtype_bytes) == kv


def test_kv_bytes_agree_with_a_real_cache() -> None:
    from swarm.model.kvcache import KVCache

    args = ModelArgs.from_config(tiny_config(TinySpec()))
    c = KVCache(10, dtype=torch.bfloat16, device="cpu")
    c.begin(1)
    for layer in range(3):
        kv = torch.zeros(1, args.n_kv_heads, 1, args.head_dim, dtype=torch.bfloat16)
        c.update(kv, kv, layer)
    assert c.nbytes() == 3 * 10 * args.kv_bytes_per_token_per_layer(2)


def test_sliding_window_is_the_widest_layer_window() -> None:
    args = ModelArgs.from_config({**tiny_config(TinySpec(family="mistral")), "sliding_window": 32})
    assert args.sliding_window == 32
    qwen = {**tiny_config(TinySpec(family="qwen2")), "use_sliding_window": True, "sliding_window": 16,
            "max_window_layers": 2}
    assert ModelArgs.from_config(qwen).sliding_window == 16
    no_window = {**tiny_config(TinySpec(family="mistral")), "sliding_window": None}
    assert ModelArgs.from_config(no_window).sliding_window is None
