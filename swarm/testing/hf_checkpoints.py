"""Tiny random checkpoints of every supported family, written by transformers itself.

``write_family_checkpoint(out_dir, family, seed=...)`` builds the family's ``XxxForCausalLM``
from a tiny config (hidden 64, 3 layers, window ``WINDOW`` on the families that have sliding
attention, a mix of windowed and full layers where the family allows it), rescales its weights
so the next token depends on the context (transformers' 0.02-std init gives near-uniform logits,
where greedy decoding is decided by rounding noise) and saves it with ``save_pretrained``, so
the files are laid out exactly as transformers writes real checkpoints (Mixtral's per-expert
``block_sparse_moe`` tensors, Phi-3's fused ``qkv_proj``, ...).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

WINDOW = 8  # prompts in the tests are longer than this

_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": None,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

_MOE4 = {"num_experts_per_tok": 2}

# family -> (model_type, config overrides)
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3_moe": ("qwen3_moe", {**_MOE4, "num_experts": 4, "moe_intermediate_size": 32,
                                "use_sliding_window": True, "sliding_window": WINDOW, "norm_topk_prob": True}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "phi3": ("phi3", {"sliding_window": WINDOW}),
    "mixtral": ("mixtral", {**_MOE4, "num_local_experts": 4, "sliding_window": WINDOW}),
    "gpt_oss": ("gpt_oss", {**_MOE4, "num_local_experts": 4, "sliding_window": WINDOW, "intermediate_size": 64,
                            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "deepseek_v3": ("deepseek_v3", {**_MOE4, "n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 32,
                                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
                                    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                    "v_head_dim": 16, "head_dim": 8, "rope_interleave": True}),
    "glm4_moe": ("glm4_moe", {**_MOE4, "n_routed_experts": 4, "n_shared_experts": 1, "moe_intermediate_size": 32,
                              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                              "partial_rotary_factor": 0.5, "use_qk_norm": True}),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def family_config(family: str, **overrides: Any) -> Any:
    """The transformers config of ``family``'s tiny model."""
    from transformers import AutoConfig

    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    model_type, extra = FAMILY_CONFIGS[family]
    return AutoConfig.for_model(model_type, **{**_BASE, **extra, **overrides})


def _rescale(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tied = getattr(model.config, "tie_word_embeddings", False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                std = (0.15 if "gemma" in model.config.model_type else 2.0) if tied else 1.0
            elif name.startswith("lm_head"):
                std = 2.0
            elif p.dim() == 1:
                base = 1.0 if "norm" in name else 0.0  # Gemma norms scale by (1 + w): 2x
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
                continue
            else:
                std = 1.0 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=g) * std)


def write_family_checkpoint(out_dir: str | Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a seeded tiny ``family`` model with ``save_pretrained``; return the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides), dtype=torch.float32)
    _rescale(model, seed)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


# MXFP4 (OCP Microscaling, E2M1 elements): the 16 values a 4-bit code stands for
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., N, K) -> (blocks (..., N, K/32, 16) uint8, scales (..., N, K/32) uint8), as gpt-oss
    stores its experts: per 32 inputs a power-of-two scale (exponent + 127) and FP4 codes, two per
    byte (even input in the low nibble)."""
    *lead, n, k = w.shape
    g = w.float().reshape(*lead, n, k // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0**-100)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)  # 6 = 1.5 * 2^2: the largest code
    scaled = g / torch.exp2(exp)[..., None]
    table = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)  # (..., N, K/32, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weights (..., N, K) float32 that ``mxfp4_encode``'s output stands for."""
    table = torch.tensor(FP4_VALUES)
    codes = torch.stack([blocks & 0xF, blocks >> 4], -1).flatten(-2).long()  # (..., N, K/32, 32)
    w = table[codes] * torch.exp2(scales.float() - 127)[..., None]
    return w.flatten(-2)


def write_mxfp4_gpt_oss(out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny gpt-oss checkpoint laid out as the released ones are: its experts' ``gate_up_proj``
    and ``down_proj`` as MXFP4 ``*_blocks``/``*_scales`` tensors and a ``quantization_config``."""
    from safetensors.torch import load_file, save_file

    out = write_family_checkpoint(out_dir, "gpt_oss", seed=seed, **overrides)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)  # (E, in, out): transformers' gpt-oss layout; the blocks run along "in"
        blocks, scales = mxfp4_encode(w.transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
