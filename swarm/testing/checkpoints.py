"""Seeded random tiny checkpoints written as real Hugging Face style directories.

``write_checkpoint(out_dir, TinySpec(family=...), seed=..., dtype=..., shards=...)`` writes ``config.json`` and either one
``model.safetensors`` or shards plus ``model.safetensors.index.json``, exactly as
``save_pretrained`` lays them out, so both this project and transformers load them.

Families: ``llama`` (Llama 3 style: GQA and llama3 ``rope_scaling``), ``llama2`` (no scaling, MHA
allowed), ``mistral``, ``qwen2`` (q/k/v biases), ``smollm`` (Llama with tied embeddings).

Random weights normally give near-uniform logits, where greedy decoding is decided by rounding
noise. These are scaled so layers contribute O(1) updates to the residual stream (weights ~
1/sqrt(fan_in), ``residual_gain`` for tied models whose embedding would otherwise predict the
current token again), so the next token depends on the context, and the LM head is large
(``head_std``, optionally log-normal row gains) so logits span tens of units. Near-ties still occur
now and then, so the golden tests check at every step that the reference's top-2 gap exceeds our
numerical disagreement with it; a seed that yields a near-tie fails loudly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "llama2", "mistral", "qwen2", "smollm")


@dataclass(frozen=True)
class TinySpec:
    family: str = "llama"
    n_layers: int = 4
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None
    intermediate_size: int = 128
    vocab_size: int = 256
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    head_std: float = 2.0
    row_gain_spread: float = 0.0  # log-normal spread of LM head row norms (peakier logits)
    residual_gain: float = 1.0  # scale of o_proj/down_proj (how much each layer moves the stream)
    extra: dict[str, Any] = field(default_factory=dict)  # merged into config.json last


def tiny_config(spec: TinySpec) -> dict[str, Any]:
    """The config.json dict of a tiny checkpoint of ``spec.family``."""
    if spec.family not in FAMILIES:
        raise ValueError(f"unknown family {spec.family!r}; choose one of {FAMILIES}")
    arch = {
        "llama": "LlamaForCausalLM",
        "llama2": "LlamaForCausalLM",
        "smollm": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }[spec.family]
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[arch]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.dim,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.family == "smollm",
        "bos_token_id": 1,
        "eos_token_id": None,
        "attention_dropout": 0.0,
    }
    if spec.head_dim is not None:
        cfg["head_dim"] = spec.head_dim
    if spec.family == "llama":
        # small original context so the llama3 scaling touches low, medium and high frequencies
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    if spec.family == "llama2":
        cfg["attention_bias"] = False
    if spec.family == "mistral":
        cfg["sliding_window"] = spec.max_position_embeddings
    if spec.family == "qwen2":
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = spec.n_layers
    cfg.update(spec.extra)
    return cfg


def random_tensors(spec: TinySpec, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 tensors with Hugging Face names for ``spec`` (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    hd = spec.head_dim or spec.dim // spec.n_heads
    q, kv = spec.n_heads * hd, spec.n_kv_heads * hd

    def w(rows: int, cols: int, std: float | None = None) -> torch.Tensor:
        s = std if std is not None else 1.0 / math.sqrt(cols)
        return torch.randn(rows, cols, generator=g) * s

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w(spec.vocab_size, spec.dim, 1.0)}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(spec.dim)
        t[p + "post_attention_layernorm.weight"] = norm(spec.dim)
        t[p + "self_attn.q_proj.weight"] = w(q, spec.dim, 2.0 / math.sqrt(spec.dim))
        t[p + "self_attn.k_proj.weight"] = w(kv, spec.dim, 2.0 / math.sqrt(spec.dim))
        t[p + "self_attn.v_proj.weight"] = w(kv, spec.dim)
        t[p + "self_attn.o_proj.weight"] = w(spec.dim, q, spec.residual_gain / math.sqrt(q))
        if spec.family == "qwen2":
            t[p + "self_attn.q_proj.bias"] = 0.5 * torch.randn(q, generator=g)
            t[p + "self_attn.k_proj.bias"] = 0.5 * torch.randn(kv, generator=g)
            t[p + "self_attn.v_proj.bias"] = 0.5 * torch.randn(kv, generator=g)
        t[p + "mlp.gate_proj.weight"] = w(spec.intermediate_size, spec.dim)
        t[p + "mlp.up_proj.weight"] = w(spec.intermediate_size, spec.dim)
        t[p + "mlp.down_proj.weight"] = w(
            spec.dim, spec.intermediate_size, spec.residual_gain / math.sqrt(spec.intermediate_size)
        )
    t["model.norm.weight"] = norm(spec.dim)
    if spec.family == "smollm":
        # tied: the head is the embedding, so scale the embedding up to make logits peaky
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"] * spec.head_std * _row_gains(spec, g)
    else:
        t["lm_head.weight"] = w(spec.vocab_size, spec.dim, spec.head_std) * _row_gains(spec, g)
    return t


def _row_gains(spec: TinySpec, g: torch.Generator) -> torch.Tensor:
    """Log-normal per-token gains (V, 1): the arg-max stands well clear of the runner-up."""
    return torch.exp(spec.row_gain_spread * torch.randn(spec.vocab_size, 1, generator=g))


def write_checkpoint(
    out_dir: str | Path,
    spec: TinySpec | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
) -> Path:
    """Write config.json + model.safetensors (or ``shards`` files and an index); return the dir."""
    from safetensors.torch import save_file

    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(spec)
    config["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.to(dtype).contiguous() for k, v in random_tensors(spec, seed).items()}
    meta = {"format": "pt"}
    if shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return out
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(out / fname), metadata=meta)
        for k in part:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


# ------------------------------------------------------------------------------ split helpers
def contiguous_splits(n_layers: int, n_stages: int | None = None) -> list[list[tuple[int, int]]]:
    """Every way to cut layers 0..n_layers-1 into contiguous blocks (optionally exactly n_stages)."""
    out: list[list[tuple[int, int]]] = []
    for mask in range(1 << (n_layers - 1)):
        cuts = [i + 1 for i in range(n_layers - 1) if mask >> i & 1]
        bounds = [0, *cuts, n_layers]
        split = list(zip(bounds[:-1], bounds[1:], strict=True))
        if n_stages is None or len(split) == n_stages:
            out.append(split)
    return sorted(out, key=len)


def balanced_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """n_stages contiguous blocks whose sizes differ by at most one (earlier blocks larger)."""
    from swarm.model.generate import split_layers

    return split_layers(n_layers, n_stages)


def greedy_tokens(
    head: Any,
    stages: list[Any],
    session: Any,
    prompt: list[int],
    max_new_tokens: int,
    logits_out: list[torch.Tensor] | None = None,
) -> list[int]:
    """Plain greedy decoding through a chain of stages, chunked as transformers' generate is.

    The prompt is one prefill chunk, then one token per step; logits only of the last row. The
    session must already be open on every stage. ``logits_out`` collects each step's logits.
    """
    ids = torch.tensor(prompt, dtype=torch.int64)
    out: list[int] = []
    for _ in range(max_new_tokens):
        h = head.embed(ids)
        for s in stages:
            h = s(session, h)
        logits = head.logits(h[-1:])[0]  # (V,) float32
        if logits_out is not None:
            logits_out.append(logits)
        tok = int(logits.argmax())
        out.append(tok)
        ids = torch.tensor([tok], dtype=torch.int64)
    return out
