"""``ModelArgs``: the facts about a checkpoint the swarm needs, built from its config.json.

The model itself is transformers' (families.py): ``config`` keeps the parsed config.json, and
``families.hf_config(config)`` turns it into the family's transformers config. The fields here
are what the rest of the swarm reads without building a model: sizes for the planner and the
wire (``dim``), the vocabulary, the special tokens, the context limit. Byte counts come from
the family's own modules built on the meta device, so a MoE layer is budgeted with all its
experts, router and shared experts, and a tied head is counted once.

Supported architectures are ``families.ARCHITECTURES``; anything else is refused with a
:class:`swarm.errors.ConfigError` naming the architecture. Every missing or malformed field we
read raises a ConfigError naming the field and the file it came from.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.errors import ConfigError
from swarm.model import llama_layers
from swarm.model.families import ARCHITECTURES, architecture_of, hf_config, layer_window, meta_sizes


@dataclass(frozen=True)
class ModelArgs:
    architecture: str  # transformers model_type: "llama", "qwen3_moe", "gemma3_text", ...
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # the widest attention window of any layer (None: all full)
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # config.json
    # what its tokenizer holds loaded (tokenizer.resident_bytes; 0: not known), a coordinator's overhead
    tokenizer_bytes: int = field(default=0, compare=False)
    # the compact format that keeps its LM head as stored (packaged.stored_head_quant: "int8" for a
    # head stored in 5 to 8 bits, as both bundled models' are); a quantized swarm's coordinator
    # holds such a head int8 below fp32 (capability.swarm_head_quant), which its budget counts
    head_stored: str = field(default="none", compare=False)

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, config: dict[str, Any], *, where: str = "config.json") -> ModelArgs:
        """Build from a parsed config.json; ConfigError names the offending field and ``where``."""
        if not isinstance(config, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(config).__name__}")
        arch = ARCHITECTURES[architecture_of(config, where)]
        dim = _int(config, "hidden_size", where)
        n_layers = _int(config, "num_hidden_layers", where)
        n_heads = _int(config, "num_attention_heads", where)
        n_kv_heads = _int(config, "num_key_value_heads", where, default=n_heads)
        if n_heads % n_kv_heads:
            raise ConfigError(
                f"{where}: num_attention_heads ({n_heads}) is not a multiple of "
                f"num_key_value_heads ({n_kv_heads})"
            )
        if config.get("head_dim") is None:
            if dim % n_heads:
                raise ConfigError(
                    f"{where}: hidden_size ({dim}) is not divisible by num_attention_heads ({n_heads}) "
                    "and no head_dim is given"
                )
            head_dim = dim // n_heads
        else:
            head_dim = _int(config, "head_dim", where)
        vocab = _int(config, "vocab_size", where)
        for key in ("rms_norm_eps", "rope_theta"):
            if config.get(key) is not None:
                _float(config, key, where)
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
        _bool(config, "tie_word_embeddings", where, default=False)
        if llama_layers.supports(config):  # no transformers import where the hand-written layers run
            tie = bool(config.get("tie_word_embeddings", False))
            w = llama_layers.sliding_window(config)
            windows = [] if w is None else [int(w)]
        else:
            hf = hf_config(config, where=where)
            tie = bool(getattr(hf, "tie_word_embeddings", False))  # the family's default when absent
            windows = [w for w in (layer_window(hf, i) for i in range(n_layers)) if w is not None]
        return cls(
            architecture=arch,
            vocab_size=vocab,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            max_seq_len=_int(config, "max_position_embeddings", where, default=2048),
            tie_word_embeddings=tie,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            sliding_window=max(windows) if windows else None,
            config=dict(config),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArgs:
        """Read ``path/config.json``."""
        _raw, config = read_config(path)
        return cls.from_config(config, where=str(Path(path) / "config.json"))

    # ----------------------------------------------------------------------------- sizes
    def _sizes(self, dtype_bytes: int = 2) -> tuple[list[int], int, int, int, list[list[tuple[int, int, int]]]]:
        """(per-layer bytes at ``dtype_bytes``, embedding, final norm, lm_head counts, per-layer
        quantizable weight shapes)."""
        if llama_layers.supports(self.config):
            counts, emb, norm, head, shapes = llama_layers.sizes(self.config)
            return [n * dtype_bytes for n in counts], emb, norm, head, shapes
        return meta_sizes(self.config, dtype_bytes)

    def layer_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights of the largest decoder layer (all experts, router, norms)."""
        return max(self.layer_bytes_each(dtype_bytes))

    def layer_bytes_each(self, dtype_bytes: int) -> list[int]:
        """Bytes of each decoder layer (they differ where some layers are dense, e.g. DeepSeek),
        as a stage holds them: a family's float32 routers and persistent buffers included."""
        return self._sizes(dtype_bytes)[0]

    def quantizable_shapes(self) -> list[list[tuple[int, int, int]]]:
        """Per layer, (count, out, in) of each weight quantization replaces: every nn.Linear
        (count 1) and every fused experts projection (count = experts)."""
        return self._sizes()[4]

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int) -> int:
        """Bytes one cached token costs in one layer (keys and values). DeepSeek-V3's multi-head
        latent attention caches its compressed latent and the shared RoPE key instead
        (transformers' attention writes ``kv_lora_rank + qk_rope_head_dim`` values per token)."""
        if self.architecture == "deepseek_v3" and self.config.get("kv_lora_rank"):
            return (int(self.config["kv_lora_rank"]) + int(self.config.get("qk_rope_head_dim") or 0)) * dtype_bytes
        return 2 * self.n_kv_heads * self.head_dim * dtype_bytes

    def activation_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """What a forward of ``tokens`` tokens through one layer holds at once: the residual stream
        and its norm, queries and attention output, and the MLP's gate, up and product (an MoE
        layer's routed experts run a few tokens each, so its shared width stands in)."""
        c = self.config
        ffn = int(c.get("intermediate_size") or c.get("moe_intermediate_size") or 4 * self.dim)
        return tokens * (3 * self.dim + 2 * self.n_heads * self.head_dim + 3 * ffn) * dtype_bytes

    def head_bytes(self, dtype_bytes: int) -> int:
        """Embedding + final norm + LM head (a tied head is counted once)."""
        _, emb, norm, head, _ = self._sizes(dtype_bytes)
        return (emb + norm + head) * dtype_bytes

    def head_int8_bytes(self) -> int:
        """What holding the LM head int8 beside its dense weight adds (Head.hold_head_int8): the
        packed integers V*K and their scales, and as much again for packing's copies and the
        allocator's slack after them (measured on the bundled model: +28 MB resident once trimmed,
        +64 to +97 MB untrimmed, its V*K being 27 MB; Gemma 3 270M +271 MB, V*K 160 MB)."""
        return 2 * self.vocab_size * self.dim + 8 * self.vocab_size


# ------------------------------------------------------------------------------------ helpers
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


def read_config(path: str | Path) -> tuple[bytes, dict[str, Any]]:
    """``path/config.json`` as its bytes and its JSON; ConfigError naming the file if unreadable."""
    file = Path(path) / "config.json"
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{file}: not found (is {path} a model directory?)") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot read: {e}") from None
    try:
        return raw, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON: {e}") from None
