"""transformers as the model runtime: each family's own causal-LM classes, built on the meta device
(and the one module that imports transformers: its GGUF tokenizer converter is reached here too).

Theory of operation
-------------------
We do not write decoder layers. For a checkpoint's config.json we build transformers' own
``XxxForCausalLM`` on the ``meta`` device (no memory, no random init), keep the modules a part
needs (a stage: ``model.layers[start:end]``; the coordinator: ``embed_tokens``, ``norm``,
``lm_head``) and load only their tensors from a :class:`~swarm.model.weights.TensorSource` through
transformers' own checkpoint conversion (``conversion_mapping``: e.g. Mixtral's per-expert
``block_sparse_moe.experts.N.w1`` fused into ``mlp.experts.gate_up_proj``), so the names and
layouts a checkpoint uses are transformers' business, not ours.

What we do own, because a ring needs it and transformers' ``Cache`` classes do not provide it,
is the per-session KV cache (kvcache.py: rollback to any position, several sessions per stage)
and therefore the attention masks: each layer attends to keys ``k`` with ``k <= q`` and, on a
sliding-window layer, ``k > q - window`` (``masking_utils.sliding_window_overlay``). Windowed
layers keep every position's K/V (rollback stays a truncation); the window is applied by the mask.
Which layers are windowed follows each family's ``forward``: ``config.layer_types`` where the
family has it, else ``config.sliding_window`` for the families whose model applies it to every
layer (:data:`_WINDOW_EVERY_LAYER`).

Rotary embeddings come from the model's own rotary module, called per forward with the chunk's
positions (so dynamic rope types such as Phi-3's longrope switch exactly as in transformers).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from swarm.errors import ConfigError, WeightsError
from swarm.model.quant_experts import expert_shapes, is_experts

# HF "architectures" entry -> model_type (the families we prove against transformers' generate)
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
}
MODEL_TYPES: dict[str, str] = {v: k for k, v in ARCHITECTURES.items()}
MODEL_TYPES["gemma3"] = "Gemma3ForCausalLM"  # text-only checkpoints sometimes say "gemma3"

# checkpoints quantized at rest that a stage dequantizes as it loads them (quant_method, model_type):
# gpt-oss's MXFP4 experts, through transformers' own MXFP4 integration (its Mxfp4Dequantize op, the
# CPU path from_pretrained takes without a GPU kernel); --quant int8/int4 then re-packs them
_DEQUANTIZED_AT_LOAD = frozenset({("mxfp4", "gpt_oss")})
_PACKED_SUFFIXES = ("_blocks", "_scales")  # MXFP4's uint8 tensors, read as stored

# families whose model forward applies config.sliding_window to every layer (no layer_types)
_WINDOW_EVERY_LAYER = frozenset({"mistral", "mixtral", "phi3", "qwen3_moe"})


def hf_config(raw: dict[str, Any], *, where: str) -> Any:
    """A transformers config for a supported architecture (ConfigError names it otherwise)."""
    import transformers

    arch = architecture_of(raw, where)
    model_type = ARCHITECTURES[arch]
    qc = raw.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        if (method, model_type) not in _DEQUANTIZED_AT_LOAD:
            raise ConfigError(
                f"{where}: {arch} weights quantized with {method!r} are not supported "
                f"(supported: {', '.join(f'{m} ({t})' for m, t in sorted(_DEQUANTIZED_AT_LOAD))}; or unquantized "
                "bf16/fp32 weights, which --quant int8/int4 quantizes on load)"
            )
    cfg = dict(raw)
    cfg["model_type"] = model_type
    cfg["architectures"] = [arch]
    try:
        config_cls = transformers.CONFIG_MAPPING[model_type]
        config = config_cls.from_dict(cfg)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: transformers rejects this {arch} config: {e}") from None
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError(f"{where}: use_bidirectional_attention=true is not a causal language model")
    return config


def architecture_of(raw: dict[str, Any], where: str) -> str:
    """The supported HF class name this config asks for."""
    archs = raw.get("architectures")
    supported = ", ".join(sorted(ARCHITECTURES))
    if archs is not None:
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{where}: architectures must be a non-empty list of names, got {archs!r}")
        for a in archs:
            if a in ARCHITECTURES:
                return a
        raise ConfigError(
            f"{where}: architectures {archs}: {', '.join(archs)} is not supported (supported: {supported})"
        )
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ConfigError(
        f"{where}: neither architectures nor model_type names a supported model "
        f"(model_type={model_type!r}; supported: {supported})"
    )


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _decode_sdpa(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except one unmasked query with grouped KV heads: there the
    query heads sharing a KV head are packed as a short "sequence" (as transformers itself does
    for a masked query) instead of SDPA's ``enable_gqa``, which measured 2x slower per call in
    bf16 on an AVX2 CPU (111 vs 54 us for SmolLM2's 9/3 heads, 60 keys)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, h, t, d = query.shape
    packable = t == 1 and groups > 1 and key.shape[1] * groups == h
    if not packable or attention_mask is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
    q = query.reshape(b, h // groups, groups, d)  # (B, KV, n_rep, hd)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, scale=kwargs.get("scaling"))
    return out.reshape(b, h, 1, d).transpose(1, 2), None  # (B, 1, H, hd)


_ATTENTION = "swarm_sdpa"


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTENTION, _decode_sdpa)


def meta_model(config: Any, dtype: torch.dtype) -> Any:
    """The family's ``XxxForCausalLM`` on the meta device (attention implementation chosen by
    transformers as ``from_pretrained`` would: sdpa where the family supports it, else eager;
    sdpa then runs through :func:`_decode_sdpa`)."""
    import transformers

    _quiet_transformers()
    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    if model.config._attn_implementation == "sdpa":
        _register_attention()
        model.config._attn_implementation = _ATTENTION
    return model.eval().requires_grad_(False)


# per decoder layer: its quantizable weights as (count, out, in): each nn.Linear (count 1) and each
# fused experts projection (count = experts)
WeightShapes = list[list[tuple[int, int, int]]]
_SIZE_DTYPES = {2: torch.bfloat16, 4: torch.float32}


@functools.lru_cache(maxsize=8)
def _meta_sizes(config_json: str, dtype_bytes: int) -> tuple[list[int], int, int, int, WeightShapes]:
    """(per-layer bytes, embedding, final norm, lm_head parameter counts, per-layer quantizable
    weight shapes) of the full model, built on the meta device in the serving dtype of that width.

    Layer bytes are measured, not multiplied: parameters and persistent buffers at the dtypes the
    family gives them (DeepSeek-V3 and GLM-4.5 keep their routers in float32 whatever the model's
    dtype; the router's score-correction bias is a buffer)."""
    if dtype_bytes not in _SIZE_DTYPES:
        raise ValueError(f"sizes are measured for 2- or 4-byte dtypes, not {dtype_bytes}-byte ones")
    raw = json.loads(config_json)
    model = meta_model(hf_config(raw, where="config.json"), _SIZE_DTYPES[dtype_bytes])
    inner = model.model
    per_layer = [_resident_bytes(layer) for layer in inner.layers]
    emb = sum(p.numel() for p in inner.embed_tokens.parameters())
    norm = sum(p.numel() for p in inner.norm.parameters())
    head = 0 if _tied(model) else sum(p.numel() for p in model.lm_head.parameters())
    weights: WeightShapes = []
    for layer in inner.layers:
        shapes = [(1, m.out_features, m.in_features) for m in layer.modules() if isinstance(m, nn.Linear)]
        shapes += [s for m in layer.modules() if is_experts(m) for s in expert_shapes(m)]
        weights.append(shapes)
    return per_layer, emb, norm, head, weights


def _resident_bytes(module: nn.Module) -> int:
    """Parameters and persistent buffers (what a checkpoint fills and a stage keeps)."""
    persistent = [
        b for m in module.modules() for name, b in m.named_buffers(recurse=False)
        if name not in m._non_persistent_buffers_set
    ]
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *persistent])


def meta_sizes(raw: dict[str, Any], dtype_bytes: int) -> tuple[list[int], int, int, int, WeightShapes]:
    return _meta_sizes(json.dumps(raw, sort_keys=True), dtype_bytes)


def _tied(model: Any) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def layer_window(config: Any, layer: int) -> int | None:
    """The attention window of ``layer`` (None: full causal attention), as the family's forward has it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[layer] == "sliding_attention" else None
    return window if config.model_type in _WINDOW_EVERY_LAYER else None


def layer_type(config: Any, layer: int) -> str:
    types = getattr(config, "layer_types", None)
    return str(types[layer]) if types is not None else "full_attention"


class Rotary:
    """The model's rotary module on a real device, called with the chunk's positions."""

    def __init__(self, model: Any, device: torch.device) -> None:
        meta_rot = model.model.rotary_emb
        with torch.device(device):  # constructors differ in taking a device argument
            self.module = type(meta_rot)(config=model.config)
        self.by_type = "layer_type" in inspect.signature(self.module.forward).parameters

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.by_type:
            return self.module(x, position_ids, kind)  # type: ignore[no-any-return]
        return self.module(x, position_ids)  # type: ignore[no-any-return]


def load_modules(
    model: Any,
    source: Any,
    names: Iterable[str],
    targets: dict[str, nn.Module],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Read checkpoint tensors ``names`` and load them into ``model`` with transformers' conversion.

    ``targets`` maps a state-dict prefix (``model.layers.3.``) to a module that must come out fully
    loaded: any of its parameters still on meta afterwards is a missing tensor (WeightsError);
    on the meta device itself, one transformers' loading info lists as missing.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    quantizer = _dequantizer(model.config)
    packed = _PACKED_SUFFIXES if quantizer is not None else ()
    # tensors quantized at rest stay in their stored integer dtype until the quantizer's op decodes them
    state = {n: source.load(n, torch.uint8 if n.endswith(packed) else dtype, device) for n in names}
    if not state:
        raise WeightsError(f"{source.path}: none of the tensors of {', '.join(targets)} are in the checkpoint")
    mapping = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    cfg = LoadStateDictConfig(
        dtype=dtype, weight_mapping=mapping, device_map={"": device}, hf_quantizer=quantizer  # type: ignore[arg-type]
    )
    info, _ = convert_and_load_state_dict_in_model(model, state, cfg)
    if info.mismatched_keys:
        name, got, want = sorted(info.mismatched_keys)[0]
        raise WeightsError(
            f"{source.path}: tensor {name} has shape {list(got)} but config.json implies {list(want)}"
        )
    if info.conversion_errors:
        key, err = sorted(info.conversion_errors.items())[0]
        raise WeightsError(f"{source.path}: converting tensor {key}: {err}")
    for prefix, module in targets.items():
        for pname, p in module.named_parameters():
            # on meta (tests place stages there) a loaded tensor is on meta too: ask transformers
            if (f"{prefix}{pname}" in info.missing_keys) if device.type == "meta" else p.device.type == "meta":
                raise WeightsError(f"{source.path}: tensor {prefix}{pname} is missing")
    _fix_buffers(targets.values(), device)


def _dequantizer(config: Any) -> Any:
    """transformers' quantizer for a checkpoint quantized at rest, set to dequantize (None: plain).

    For MXFP4 that is ``Mxfp4HfQuantizer(Mxfp4Config(dequantize=True))``: the conversion mapping it
    extends turns each expert projection's ``*_blocks`` and ``*_scales`` into the float 3-D
    parameter the family's experts module holds, at the serving dtype."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(method, "value", method)) != "mxfp4":
        raise ConfigError(f"{config.architectures[0]}: no dequantizer for {method!r} weights")
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
    from transformers.utils.quantization_config import Mxfp4Config

    return Mxfp4HfQuantizer(Mxfp4Config(dequantize=True), pre_quantized=True)


def _fix_buffers(modules: Iterable[nn.Module], device: torch.device) -> None:
    """Non-persistent buffers a meta build leaves empty (Gemma's embedding scale)."""
    for m in modules:
        for sub in m.modules():
            scale = getattr(sub, "scalar_embed_scale", None)
            if scale is not None:
                sub.embed_scale = torch.tensor(float(scale), device=device)
            for bname, b in sub.named_buffers(recurse=False):
                if b.device.type == "meta":
                    raise WeightsError(f"buffer {bname} of {type(sub).__name__} was not initialised")


def tensor_names(source: Any, prefixes: Iterable[str]) -> list[str]:
    pre = tuple(prefixes)
    return [n for n in source.names() if n.startswith(pre)]


def tie_head(model: Any) -> None:
    if _tied(model):
        model.lm_head.weight = model.model.embed_tokens.weight


def final_softcap(config: Any) -> float | None:
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def gguf_tokenizer(path: str) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """transformers' GGUF tokenizer converter: (tokenizers.Tokenizer, the tokenizer fields it read,
    tokenizer_config fields, the file's metadata with string arrays left as counts)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.integrations.gguf.reader import read_gguf_metadata

    _quiet_transformers()
    arch, tdict, tcfg = get_gguf_tokenizer(path)
    tok, _ = convert_gguf_tokenizer(arch, tdict)
    md, _ = read_gguf_metadata(path)
    return tok, tdict, tcfg, md
