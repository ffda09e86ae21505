"""``ModelArgs``: one dataclass for the Llama family, built from a Hugging Face config.json.

Families differ by fields, not by code paths:

- Llama 2/3 (``LlamaForCausalLM``): grouped-query attention (``num_key_value_heads``), optional
  ``rope_scaling`` of type ``llama3`` (also accepted: null, or type ``default``).
- SmolLM / SmolLM2: Llama with ``tie_word_embeddings: true`` (the LM head *is* the embedding).
- Mistral (``MistralForCausalLM``): Llama with an optional ``sliding_window``. We do **not**
  implement windowed attention; instead a KV cache longer than the window is refused when a
  session is opened (``ModelArgs.check_context``), so a result is never silently wrong. Within the
  window, full causal attention *is* sliding-window attention.
- Qwen2 (``Qwen2ForCausalLM``): biases on q/k/v projections (``qkv_bias``); ``use_sliding_window``
  is handled like Mistral's window.

Every missing or malformed field raises :class:`swarm.errors.ConfigError` naming the field and the
file it came from. The byte-count helpers are what the planner uses to place layers on peers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError

# HF "architectures" entry -> our family name
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
SUPPORTED_ACTS = ("silu",)


@dataclass(frozen=True)
class ModelArgs:
    architecture: str  # "llama" (also SmolLM), "mistral", "qwen2"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # llama3 scaling: factor, low/high_freq_factor, original_max_position_embeddings
    max_seq_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # attention window (Mistral, Qwen2); contexts past it are refused

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, config: dict[str, Any], *, where: str = "config.json") -> ModelArgs:
        """Build from a parsed config.json; ConfigError names the offending field and ``where``."""
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(config).__name__}")
        arch = _architecture(config, where)
        dim = _int(config, "hidden_size", where)
        n_heads = _int(config, "num_attention_heads", where)
        n_kv_heads = _int(config, "num_key_value_heads", where, default=n_heads)
        if n_heads % n_kv_heads:
            raise ConfigError(
                f"{where}: num_attention_heads ({n_heads}) is not a multiple of "
                f"num_key_value_heads ({n_kv_heads})"
            )
        head_dim_raw = config.get("head_dim")
        if head_dim_raw is None:
            if dim % n_heads:
                raise ConfigError(
                    f"{where}: hidden_size ({dim}) is not divisible by num_attention_heads ({n_heads}) "
                    "and no head_dim is given"
                )
            head_dim = dim // n_heads
        else:
            head_dim = _int(config, "head_dim", where)
        if head_dim % 2:
            raise ConfigError(f"{where}: head_dim must be even for rotary embeddings, got {head_dim}")
        act = config.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTS:
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
        if config.get("mlp_bias"):
            raise ConfigError(f"{where}: mlp_bias=true is not supported")
        if arch == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(config.get("attention_bias", False))
            if qkv_bias:
                raise ConfigError(
                    f"{where}: attention_bias=true is not supported for {arch} (it would also bias o_proj)"
                )
        rope_theta = _float(config, "rope_theta", where, default=10000.0)
        rope_scaling = _rope_scaling(config, where)
        sliding_window: int | None = None
        if arch == "mistral" and config.get("sliding_window") is not None:
            sliding_window = _int(config, "sliding_window", where)
        if arch == "qwen2" and config.get("use_sliding_window") and config.get("sliding_window"):
            sliding_window = _int(config, "sliding_window", where)
        eos = config.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos_ids = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_ids = tuple(eos)
        else:
            raise ConfigError(f"{where}: eos_token_id must be an int or a list of ints, got {eos!r}")
        bos = config.get("bos_token_id")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise ConfigError(f"{where}: bos_token_id must be an int or null, got {bos!r}")
        return cls(
            architecture=arch,
            vocab_size=_int(config, "vocab_size", where),
            dim=dim,
            n_layers=_int(config, "num_hidden_layers", where),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(config, "intermediate_size", where),
            norm_eps=_float(config, "rms_norm_eps", where, default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=_int(config, "max_position_embeddings", where, default=2048),
            tie_word_embeddings=_bool(config, "tie_word_embeddings", where, default=False),
            qkv_bias=qkv_bias,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            sliding_window=sliding_window,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArgs:
        """Read ``path/config.json``."""
        file = Path(path) / "config.json"
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{file}: not found (is {path} a model directory?)") from None
        except OSError as e:
            raise ConfigError(f"{file}: cannot read: {e}") from None
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON: {e}") from None
        return cls.from_config(config, where=str(file))

    # ----------------------------------------------------------------------------- sizes
    def layer_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights of one decoder layer (attention, MLP, two norms)."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * q + 2 * self.dim * kv + q * self.dim
        if self.qkv_bias:
            attn += q + 2 * kv
        mlp = 3 * self.dim * self.intermediate_size
        norms = 2 * self.dim
        return (attn + mlp + norms) * dtype_bytes

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int) -> int:
        """Bytes one cached token costs in one layer (keys and values)."""
        return 2 * self.n_kv_heads * self.head_dim * dtype_bytes

    def head_bytes(self, dtype_bytes: int) -> int:
        """Embedding + final norm + LM head (a tied head is counted once)."""
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return (emb + self.dim + head) * dtype_bytes

    # ----------------------------------------------------------------------------- checks
    def check_context(self, max_len: int) -> None:
        """Refuse a KV cache longer than the attention window (we run full causal attention)."""
        if self.sliding_window is not None and max_len > self.sliding_window:
            raise ConfigError(
                f"a context of {max_len} tokens exceeds this {self.architecture} model's "
                f"sliding_window ({self.sliding_window}); windowed attention is not implemented, "
                f"so use at most {self.sliding_window} tokens"
            )


# ------------------------------------------------------------------------------------ helpers
def _architecture(config: dict[str, Any], where: str) -> str:
    archs = config.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{where}: architectures must be a non-empty list of names, got {archs!r}")
        for a in archs:
            if a in ARCHITECTURES:
                return ARCHITECTURES[a]
        raise ConfigError(
            f"{where}: architectures {archs} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[str(model_type)]
    raise ConfigError(
        f"{where}: neither architectures nor model_type names a supported model "
        f"(model_type={model_type!r}; supported: {', '.join(sorted(MODEL_TYPES))})"
    )


_MISSING = object()


def _int(config: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> int:
    v = config.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise ConfigError(f"{where}: missing field {key!r}")
        return int(default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return v


def _float(config: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> float:
    v = config.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise ConfigError(f"{where}: missing field {key!r}")
        return float(default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive number, got {v!r}")
    return float(v)


def _bool(config: dict[str, Any], key: str, where: str, default: bool) -> bool:
    v = config.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: field {key!r} must be true or false, got {v!r}")
    return v


def _rope_scaling(config: dict[str, Any], where: str) -> dict[str, Any] | None:
    rs = config.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{where}: rope_scaling must be an object or null, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(
            f"{where}: rope_scaling type {kind!r} is not supported (supported: llama3, default)"
        )
    out: dict[str, Any] = {"rope_type": "llama3"}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        out[key] = _float(rs, key, f"{where} rope_scaling")
    out["original_max_position_embeddings"] = _int(
        rs, "original_max_position_embeddings", f"{where} rope_scaling"
    )
    if out["high_freq_factor"] == out["low_freq_factor"]:
        raise ConfigError(f"{where}: rope_scaling high_freq_factor must differ from low_freq_factor")
    return out
