"""GGUF reading: layout (Q/K permutation, shapes), quant types, lazy per-tensor loads, config,
conversion, and bad files. Tiny GGUFs are written here with the ``gguf`` package's writer, laid
out the way llama.cpp's converter lays them out (Q/K rows permuted, shapes reversed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import pre_tokenizers

import swarm.model.gguf as sg
import swarm.model.gguf_archs as ga
from swarm.errors import ConfigError, ModelError, WeightsError
from swarm.model.bundled import bundled_gguf_path
from swarm.model.gguf import GGUFSource, config_from_gguf, unpermute_rope_rows
from swarm.model.gguf_convert import convert_gguf_to_hf
from swarm.model.tokenizer import tokenizer_from_gguf

torch.set_num_threads(1)
Q = gguf.GGMLQuantizationType
TINY = dict(vocab=0, hidden=64, heads=4, kv_heads=2, inter=128, layers=3)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (written from its description)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_tokens() -> tuple[list[str], list[str], list[int]]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = ["Ġt", "he", "Ġthe"]
    tokens = SPECIALS + alphabet + merged
    types = [3] * len(SPECIALS) + [1] * (len(alphabet) + len(merged))
    return tokens, ["Ġ t", "h e", "Ġt he"], types


def tiny_state(seed: int = 0, tied: bool = False, bias: bool = False) -> dict[str, np.ndarray]:
    """A random tiny Llama state dict in HF layout and names (float32)."""
    g = np.random.default_rng(seed)
    tokens, _, _ = tiny_tokens()
    v, d, h, kv, f = len(tokens), TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["inter"]
    hd = d // h

    def r(*shape: int) -> np.ndarray:
        return (g.standard_normal(shape) * 0.1).astype(np.float32)

    sd = {"model.embed_tokens.weight": r(v, d), "model.norm.weight": 1 + r(d)}
    if not tied:
        sd["lm_head.weight"] = r(v, d)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": 1 + r(d),
            p + "post_attention_layernorm.weight": 1 + r(d),
            p + "self_attn.q_proj.weight": r(h * hd, d),
            p + "self_attn.k_proj.weight": r(kv * hd, d),
            p + "self_attn.v_proj.weight": r(kv * hd, d),
            p + "self_attn.o_proj.weight": r(d, h * hd),
            p + "mlp.gate_proj.weight": r(f, d),
            p + "mlp.up_proj.weight": r(f, d),
            p + "mlp.down_proj.weight": r(d, f),
        }
        if bias:
            sd |= {
                p + "self_attn.q_proj.bias": r(h * hd),
                p + "self_attn.k_proj.bias": r(kv * hd),
                p + "self_attn.v_proj.bias": r(kv * hd),
            }
    return sd


def to_gguf_name(hf: str) -> str:
    rev = {v: k for k, v in ga.GLOBAL_NAMES.items()}
    if hf in rev:
        return rev[hf]
    parts = hf.split(".")  # model.layers.N.<a>.<b>.weight
    block = {v: k for k, v in ga.ARCHS["llama"].blocks.items()}[".".join(parts[3:-1])]
    return f"blk.{parts[2]}.{block}.{parts[-1]}"


def write_tiny_gguf(
    path: Path,
    sd: dict[str, np.ndarray],
    *,
    qtype: Q = Q.F32,
    arch: str = "llama",
    skip_keys: tuple[str, ...] = (),
    extra: Callable[[Any], None] | None = None,
) -> Path:
    tokens, merges, types = tiny_tokens()
    w = gguf.GGUFWriter(str(path), arch=arch)
    kv = {
        f"{arch}.block_count": TINY["layers"],
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": TINY["hidden"],
        f"{arch}.feed_forward_length": TINY["inter"],
        f"{arch}.attention.head_count": TINY["heads"],
        f"{arch}.attention.head_count_kv": TINY["kv_heads"],
    }
    for k, val in kv.items():
        if k not in skip_keys:
            w.add_uint32(k, val)
    if f"{arch}.attention.layer_norm_rms_epsilon" not in skip_keys:
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    if extra is not None:
        extra(w)
    for hf, arr in sd.items():
        if arch != "llama":
            pass  # qwen2 GGUFs use NeoX rope: llama.cpp does not permute them
        elif ".q_proj." in hf:
            arr = llama_cpp_permute(arr, TINY["heads"])
        elif ".k_proj." in hf:
            arr = llama_cpp_permute(arr, TINY["kv_heads"])
        t = qtype if arr.ndim == 2 else Q.F32  # llama.cpp keeps norms in F32
        if t == Q.F32:
            w.add_tensor(to_gguf_name(hf), arr)
        elif t == Q.F16:
            w.add_tensor(to_gguf_name(hf), arr.astype(np.float16))
        else:
            w.add_tensor(to_gguf_name(hf), gguf.quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    sd = tiny_state()
    return write_tiny_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", sd), sd


# ---------------------------------------------------------------------------------- layout


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    back = unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, 8)), 8)
    assert torch.equal(back, torch.from_numpy(w))
    assert not np.array_equal(llama_cpp_permute(w, 8), w)  # the permutation is not the identity


def test_f32_tensors_come_back_exactly_in_hf_layout(
    tiny: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, sd = tiny
    src = GGUFSource(path)
    assert sorted(src.names()) == sorted(sd)
    for name, want in sd.items():
        assert src.shape(name) == want.shape, name
        got = src.load(name, torch.float32)
        assert torch.equal(got, torch.from_numpy(want)), name
    assert src.load("model.norm.weight", torch.bfloat16).dtype == torch.bfloat16


def test_llama_qk_biases_are_unpermuted_too(tmp_path: Path) -> None:
    sd = tiny_state(seed=2, bias=True)
    src = GGUFSource(write_tiny_gguf(tmp_path / "b.gguf", sd))
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.2.self_attn.k_proj.bias"):
        assert torch.equal(src.load(name, torch.float32), torch.from_numpy(sd[name])), name
    assert config_from_gguf(tmp_path / "b.gguf")["attention_bias"] is True


@pytest.mark.parametrize(
    "qtype,tol",
    [
        (Q.F16, 1e-3),
        (Q.BF16, 8e-3),
        (Q.Q8_0, 1e-2),
        (Q.Q4_0, 0.15),
        (Q.Q4_1, 0.12),
        (Q.Q5_0, 0.08),
        (Q.Q5_1, 0.06),
    ],
)
def test_quantized_types_dequantize_close_to_original(tmp_path: Path, qtype: Q, tol: float) -> None:
    sd = tiny_state(seed=1)
    src = GGUFSource(write_tiny_gguf(tmp_path / f"{qtype.name}.gguf", sd, qtype=qtype))
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.2.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        want = torch.from_numpy(sd[name])
        got = src.load(name, torch.float32)
        rel = float((got - want).norm() / want.norm())
        assert rel < tol, (name, qtype.name, rel)
        assert src.gguf_type(name) == qtype.name


def test_only_requested_tensors_are_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    src = GGUFSource(bundled_gguf_path())
    seen: list[str] = []
    real = sg.GGUFFile.dequantized

    def counting(self: sg.GGUFFile, info: sg.GGUFTensorInfo, expert: int | None = None) -> np.ndarray:
        seen.append(info.name)
        return real(self, info, expert)

    monkeypatch.setattr(sg.GGUFFile, "dequantized", counting)
    wanted = [n for n in src.names() if n.startswith("model.layers.") and int(n.split(".")[2]) < 7]
    for n in wanted:
        src.load(n, torch.bfloat16)
    assert len(wanted) == 7 * 9
    assert len(seen) == len(wanted)
    assert all(s.startswith("blk.") and int(s.split(".")[1]) < 7 for s in seen)


def test_a_large_tensor_is_read_and_dequantized_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored bytes are read a chunk at a time, not whole beside the float32 output (a 262k-row
    head read whole peaked 270 MB over what it holds), and the chunks give the same floats."""
    src = GGUFSource(bundled_gguf_path())
    name = "model.embed_tokens.weight"  # Q8_0, 49152 x 576: 30 MB stored
    whole = src.load(name, torch.float32)  # the default chunk: 8 MB of output a step
    monkeypatch.setattr(sg, "DEQUANT_CHUNK_BYTES", 1 << 20)
    reads: list[int] = []
    real = sg.FileReader.tensor

    def counting(self: Any, offset: int, nbytes: int, what: str) -> torch.Tensor:
        reads.append(nbytes)
        return real(self, offset, nbytes, what)

    monkeypatch.setattr(sg.FileReader, "tensor", counting)
    small = src.load(name, torch.float32)
    assert torch.equal(small, whole)
    stored = 49152 * 576 // 32 * 34
    assert sum(reads) == stored and len(reads) > 20, reads[:3]
    assert max(reads) <= (1 << 20) // (576 * 4) * (576 // 32 * 34)


def test_bundled_source_matches_reference_facts() -> None:
    src = GGUFSource(bundled_gguf_path())
    assert len(src.names()) == 272 and "lm_head.weight" not in src.names()  # tied
    assert src.shape("model.embed_tokens.weight") == (49152, 576)
    assert src.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    assert src.gguf_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    cfg = config_from_gguf(bundled_gguf_path())
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 1e5
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["eos_token_id"] == 2


# ---------------------------------------------------------------------------------- config


def test_config_missing_key_is_named(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "m.gguf", tiny_state(), skip_keys=("llama.feed_forward_length",))
    with pytest.raises(ConfigError, match="llama.feed_forward_length") as e:
        config_from_gguf(p)
    assert "m.gguf" in str(e.value)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    p = write_tiny_gguf(tmp_path / "a.gguf", tiny_state(), arch="mamba")
    with pytest.raises(ConfigError, match="'mamba' is not supported"):
        config_from_gguf(p)
    with pytest.raises(ConfigError, match="mamba"):
        GGUFSource(p)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path) -> None:
    hd = TINY["hidden"] // TINY["heads"]
    factors = ga._llama3_rope_factors(
        10000.0, hd, 8.0, 1.0, 4.0, 64
    )  # small orig: non-trivial for hd 16

    def add(w: Any) -> None:
        w.add_tensor("rope_freqs.weight", factors)

    # 64 is not among the candidates: refuse rather than guess
    with pytest.raises(ConfigError, match="rope_freqs"):
        config_from_gguf(write_tiny_gguf(tmp_path / "bad.gguf", tiny_state(), extra=add))
    factors = ga._llama3_rope_factors(10000.0, hd, 8.0, 1.0, 4.0, 2048)  # picked up by add()
    assert not np.allclose(factors, 1.0)
    p = write_tiny_gguf(tmp_path / "l3.gguf", tiny_state(), extra=add)
    cfg = config_from_gguf(p)
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 2048,
    }
    assert "rope_freqs.weight" not in str(GGUFSource(p).names())


# ---------------------------------------------------------------------------------- bad files


def test_not_a_gguf_and_empty_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(WeightsError, match=r"x\.gguf.*not a GGUF"):
        GGUFSource(tmp_path / "x.gguf")
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(WeightsError, match="empty"):
        GGUFSource(tmp_path / "e.gguf")
    with pytest.raises(WeightsError, match="cannot open"):
        GGUFSource(tmp_path / "missing.gguf")


def test_truncated_data_names_file_and_tensor(
    tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightsError, match=r"cut\.gguf: truncated GGUF: tensor '[a-z_.0-9]+'"):
        GGUFSource(cut)
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(WeightsError, match=r"cut\.gguf: truncated or corrupt GGUF header"):
        GGUFSource(cut)


def test_unknown_tensor_and_unknown_name(tmp_path: Path) -> None:
    def add(w: Any) -> None:
        w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, dtype=np.float32))

    p = write_tiny_gguf(tmp_path / "u.gguf", tiny_state(), extra=add)
    with pytest.raises(WeightsError, match="blk.0.attn_q_norm.weight"):
        GGUFSource(p)
    src = GGUFSource(write_tiny_gguf(tmp_path / "ok.gguf", tiny_state()))
    with pytest.raises(
        WeightsError, match=r"ok\.gguf: no tensor 'model.layers.9.mlp.up_proj.weight'"
    ):
        src.load("model.layers.9.mlp.up_proj.weight", torch.float32)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keep=st.one_of(st.none(), st.integers(min_value=0, max_value=6000)),
    flips=st.lists(st.tuples(st.integers(0, 6000), st.integers(1, 255)), max_size=4),
)
def test_fuzz_corrupt_header_raises_only_our_errors(
    tiny: tuple[Path, dict[str, np.ndarray]],
    tmp_path_factory: pytest.TempPathFactory,
    keep: int | None,
    flips: list[tuple[int, int]],
) -> None:
    data = bytearray(tiny[0].read_bytes())
    for pos, x in flips:
        if pos < len(data):
            data[pos] ^= x
    p = tmp_path_factory.mktemp("fz") / "f.gguf"
    p.write_bytes(bytes(data if keep is None else data[:keep]))  # the header is the first ~5 kB
    try:
        src = GGUFSource(p)
        config_from_gguf(p)
        src.load(src.names()[-1], torch.float32)
        tokenizer_from_gguf(p)
    except ModelError:
        pass  # WeightsError / ConfigError / TokenizerError: all fine, all ours


# ---------------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_convert_tiny_matches_transformers_logits(
    tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, arch: str
) -> None:
    import transformers

    if arch == "llama":
        path, sd = tiny
    else:  # q/k/v biases, no permutation
        sd = tiny_state(seed=3, bias=True)
        path = write_tiny_gguf(tmp_path / "qwen2.gguf", sd, arch="qwen2")
    calls: list[tuple[int, int]] = []
    out = convert_gguf_to_hf(
        path, tmp_path / "hf", dtype=torch.float32, progress=lambda a, b: calls.append((a, b))
    )
    total = len(sd) + 1
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [a for a, _ in calls] == sorted(a for a, _ in calls)
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / f).is_file(), f
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    with safe_open(str(out / "model.safetensors"), "pt") as st_file:
        assert sorted(st_file.keys()) == sorted(sd)
        assert torch.equal(
            st_file.get_tensor("model.layers.2.self_attn.k_proj.weight"),
            torch.from_numpy(sd["model.layers.2.self_attn.k_proj.weight"]),
        )
    # reference: the same random weights loaded straight into transformers, no GGUF involved
    cfg = json.loads((out / "config.json").read_text())
    model_cls = getattr(transformers, cfg["architectures"][0])
    config_cls = transformers.AutoConfig.for_model(cfg["model_type"]).__class__
    assert model_cls.__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ref = model_cls(config_cls(**{k: v for k, v in cfg.items() if k != "architectures"}))
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    got = model_cls.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 80, 200, 7, 9, 100, 3]])
    with torch.no_grad():
        assert torch.allclose(got(ids).logits, ref(ids).logits, atol=1e-5)


def test_convert_is_atomic_and_replaces(
    tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    path, _ = tiny
    out = tmp_path / "hf"

    def boom(done: int, total: int) -> None:
        if done == 5:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        convert_gguf_to_hf(path, out, progress=boom)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir is left
    out.mkdir()
    (out / "stale.txt").write_text("old")
    convert_gguf_to_hf(path, out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
