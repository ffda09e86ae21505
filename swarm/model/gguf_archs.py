"""GGUF architectures: llama.cpp's tensor names and metadata keys -> transformers' names and config.

Theory of operation
-------------------
A GGUF file names its architecture (``general.architecture``), its tensors in llama.cpp's
scheme (``blk.3.attn_q.weight``) and its hyper-parameters as ``<arch>.<key>`` metadata. Each
supported architecture (:data:`ARCHS`) says which transformers class runs it and how llama.cpp's
converter changed the tensors on the way in, so :class:`swarm.model.gguf.GGUFSource` can hand
out exactly what a Hugging Face checkpoint of that family holds, under the same names
(``model.layers.3.self_attn.q_proj.weight``), and transformers' own checkpoint conversion
(families.load_modules) takes it from there:

- ``permuted``: llama.cpp permutes the rows of Q and K for its interleaved ("normal") RoPE in the
  Llama family (Llama, Mistral, Mixtral); the NeoX-rope families (Qwen, Gemma, Phi-3) are not.
- ``norm_offset``: Gemma computes ``x * (1 + w)``; llama.cpp stores ``1 + w`` in every
  ``*norm.weight`` (transformers' GGUF loader subtracts the same 1).
- ``experts``: MoE experts are stacked 3-D tensors (``ffn_gate_exps`` (E, I, D)); each expert's
  slice is offered under the per-expert name the family's checkpoints use
  (``mlp.experts.7.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.7.w1.weight``), which
  transformers fuses into its 3-D ``gate_up_proj`` as it does for a safetensors checkpoint.

The config is built from the metadata keys llama.cpp's converter writes for each family, with the
defaults llama.cpp itself assumes where a key is absent (Gemma 3's 5:1 local/global pattern and
local RoPE base 10000; Gemma 2/3's query scale of 1/sqrt(hidden / heads) for the 27B models);
anything we cannot express (Phi-3's long-context RoPE factors) is refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from swarm.errors import ConfigError, WeightsError

if TYPE_CHECKING:
    from swarm.model.gguf import GGUFFile

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTN = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma: four norms per layer; llama.cpp's ffn_norm is the one before the MLP
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
SKIPPED = {"rope_freqs.weight"}  # folded into config.json's rope_scaling


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture maps onto a transformers family."""

    hf: str  # transformers class (config.json "architectures")
    model_type: str
    blocks: dict[str, str]  # GGUF block tensor ("attn_q") -> HF name inside model.layers.N.
    permuted: bool = False  # Q/K rows permuted by llama.cpp (undone on load)
    norm_offset: float = 0.0  # subtracted from every *norm.weight
    experts: tuple[str, dict[str, str]] | None = None  # (HF prefix, GGUF stacked tensor -> HF name)
    act: dict[str, str] = field(default_factory=lambda: {"hidden_act": "silu"})


ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "llama", {**_NORMS, **_ATTN, **_MLP}, permuted=True),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", {**_NORMS, **_ATTN, **_MLP}),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", {**_NORMS, **_ATTN, **_QK_NORM, **_MLP}),
    "qwen3moe": Arch("Qwen3MoeForCausalLM", "qwen3_moe", {**_NORMS, **_ATTN, **_QK_NORM, "ffn_gate_inp": "mlp.gate"},
                     experts=("mlp.experts", _EXPERTS)),  # fmt: skip
    "gemma2": Arch("Gemma2ForCausalLM", "gemma2", {**_GEMMA_NORMS, **_ATTN, **_MLP}, norm_offset=1.0,
                   act={"hidden_activation": "gelu_pytorch_tanh"}),  # fmt: skip
    "gemma3": Arch("Gemma3ForCausalLM", "gemma3_text", {**_GEMMA_NORMS, **_ATTN, **_QK_NORM, **_MLP}, norm_offset=1.0,
                   act={"hidden_activation": "gelu_pytorch_tanh"}),  # fmt: skip
    "phi3": Arch("Phi3ForCausalLM", "phi3", {**_NORMS, "attn_qkv": "self_attn.qkv_proj",
                                             "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
                                             "ffn_down": "mlp.down_proj"}),  # fmt: skip
}
# a "llama" GGUF with experts is Mixtral (llama.cpp converts Mixtral to its llama architecture)
MIXTRAL = Arch("MixtralForCausalLM", "mixtral", {**_NORMS, **_ATTN, "ffn_gate_inp": "block_sparse_moe.gate"},
               permuted=True, experts=("block_sparse_moe.experts", {"ffn_gate_exps": "w1", "ffn_down_exps": "w2",
                                                                    "ffn_up_exps": "w3"}))  # fmt: skip


def arch_of(f: GGUFFile) -> tuple[str, Arch]:
    """(the metadata key prefix, the Arch) of a GGUF file; ConfigError naming an unsupported one."""
    name = f.metadata.get("general.architecture")
    if not isinstance(name, str):
        raise ConfigError(f"{f.path}: GGUF metadata has no 'general.architecture'")
    if name not in ARCHS:
        raise ConfigError(
            f"{f.path}: GGUF architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHS))})"
        )
    if name == "llama" and f.metadata.get("llama.expert_count", 0):
        return name, MIXTRAL
    return name, ARCHS[name]


def hf_names(arch: Arch, gguf_name: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The HF names a GGUF tensor becomes, each with its expert index (None: the whole tensor).

    [] for a tensor HF has no counterpart for by design; KeyError for one we do not know."""
    if gguf_name in SKIPPED:
        return []
    if gguf_name in GLOBAL_NAMES:
        return [(GLOBAL_NAMES[gguf_name], None)]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] not in ("weight", "bias"):
        raise KeyError(gguf_name)
    layer, kind, suffix = parts[1], parts[2], parts[3]
    if arch.experts is not None and kind in arch.experts[1] and len(shape) == 3:
        prefix, names = arch.experts
        return [(f"model.layers.{layer}.{prefix}.{e}.{names[kind]}.{suffix}", e) for e in range(shape[0])]
    if kind in arch.blocks:
        return [(f"model.layers.{layer}.{arch.blocks[kind]}.{suffix}", None)]
    raise KeyError(gguf_name)


# --------------------------------------------------------------------------------------------
# config.json from metadata


def _llama3_rope_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _rope_scaling(f: GGUFFile, prefix: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = f.metadata.get(f"{prefix}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": f.number(f"{prefix}.rope.scaling.factor", integer=False)}
    if kind not in (None, "none"):
        raise ConfigError(f"{f.path}: rope scaling {kind!r} ({prefix}.rope.scaling.type) is not supported")
    info = f.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    factors = f.dequantized(info).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    factor = float(factors.max())
    # (orig, low, high) and (k*orig, k*low, k*high) give identical factors: prefer low = 1, high = 4
    for low in (1.0, 2.0):
        for high in (4.0, 8.0, 2.0):
            for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
                want = _llama3_rope_factors(theta, head_dim, factor, low, high, orig)
                if want.shape == factors.shape and np.allclose(want, factors, rtol=1e-5):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": orig}  # fmt: skip
    raise ConfigError(f"{f.path}: rope_freqs.weight does not match any llama3 rope scaling we know")


def config_from(f: GGUFFile) -> dict[str, Any]:
    """An HF-style config.json dict from a GGUF file's metadata (ConfigError naming a bad key)."""
    prefix, arch = arch_of(f)

    def need(key: str) -> int:
        v = f.number(f"{prefix}.{key}")
        if v <= 0:
            raise ConfigError(f"{f.path}: GGUF metadata '{prefix}.{key}' = {v} must be positive")
        return int(v)

    def opt(key: str, default: Any = None, *, integer: bool = True) -> Any:
        return f.number(f"{prefix}.{key}", default, integer=integer) if f"{prefix}.{key}" in f.metadata else default

    hidden = need("embedding_length")
    n_heads = need("attention.head_count")
    n_kv = f.number(f"{prefix}.attention.head_count_kv", n_heads)
    head_dim = f.number(f"{prefix}.attention.key_length", hidden // n_heads)
    theta = f.number(f"{prefix}.rope.freq_base", 10000.0, integer=False)
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise WeightsError(f"{f.path}: GGUF file has no tensor 'token_embd.weight'")
    vocab = f.number(f"{prefix}.vocab_size", embd.shape[0])
    if vocab != embd.shape[0]:
        raise ConfigError(f"{f.path}: {prefix}.vocab_size = {vocab} but token_embd.weight has {embd.shape[0]} rows")
    n_layers = need("block_count")
    cfg: dict[str, Any] = {
        "architectures": [arch.hf],
        "model_type": arch.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        **arch.act,
        "rms_norm_eps": f.number(f"{prefix}.attention.layer_norm_rms_epsilon", integer=False),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(f, prefix, theta, head_dim),
        "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    if arch.experts is None or f"{prefix}.feed_forward_length" in f.metadata:
        cfg["intermediate_size"] = need("feed_forward_length")
    if arch.model_type == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
        cfg["mlp_bias"] = False
    if arch.experts is not None:
        experts, used = need("expert_count"), need("expert_used_count")
        if arch.model_type == "mixtral":
            cfg |= {"num_local_experts": experts, "num_experts_per_tok": used}
        else:  # qwen3moe: norm_topk_prob is what llama.cpp computes (transformers' GGUF defaults agree)
            cfg |= {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": True,
                    "moe_intermediate_size": need("expert_feed_forward_length"), "decoder_sparse_step": 1,
                    "mlp_only_layers": []}  # fmt: skip
    if arch.model_type in ("gemma2", "gemma3_text"):
        # llama.cpp scales queries by 1/sqrt(head_dim), except the 27B models (46 and 62 layers):
        # 1/sqrt(hidden / heads); Gemma's config says the same through query_pre_attn_scalar
        cfg["query_pre_attn_scalar"] = hidden // n_heads if n_layers in (46, 62) else head_dim
        cfg["sliding_window"] = need("attention.sliding_window")
    if arch.model_type == "gemma2":
        cfg["attn_logit_softcapping"] = opt("attn_logit_softcapping", integer=False)
        cfg["final_logit_softcapping"] = opt("final_logit_softcapping", integer=False)
    if arch.model_type == "gemma3_text":  # llama.cpp: every 6th layer global, local RoPE base 10000
        cfg["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)]
        cfg["rope_local_base_freq"] = 10000.0
        cfg["final_logit_softcapping"] = opt("final_logit_softcapping", integer=False)
    if arch.model_type == "phi3":
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            if name in f.tensors:
                raise ConfigError(f"{f.path}: Phi-3 long-context RoPE factors ({name}) are not supported yet")
        cfg["sliding_window"] = opt("attention.sliding_window")
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):  # fmt: skip
        if f"tokenizer.ggml.{key}" in f.metadata:
            cfg[hf_key] = f.number(f"tokenizer.ggml.{key}")
    cfg.setdefault("pad_token_id", None)  # not the family's default (Phi-3's 32000 may not exist here)
    return cfg
