"""Real models' layer shapes with random weights, for gpu_check.py: no weights are downloaded.

``published(name)`` is a model's published config.json (swarm/testing/configs); ``small(name)``
the same family and layout at a few hundred hidden units (the CPU test). :class:`RandomSource`
is a TensorSource that makes each tensor on demand, on the device it is asked for, so a 70B layer
never exists on the host: small norm-like vectors are ones, everything else ~N(0, 0.02).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from swarm.model import families
from swarm.model.config import ModelArgs

CONFIGS = Path(__file__).resolve().parents[1] / "swarm" / "testing" / "configs"


def published_config(name: str) -> dict[str, Any]:
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def published(name: str, *, layers: int | None = None) -> ModelArgs:
    """The published config (its MXFP4 quantization_config dropped: random weights are floats)."""
    cfg = published_config(name)
    cfg.pop("quantization_config", None)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
    return ModelArgs.from_config(cfg)


def small(name: str) -> ModelArgs:
    """The family's layout at small shapes: 4 layers, hidden 256, 4 heads of 64 (2 KV heads)."""
    cfg = published_config(name)
    cfg.pop("quantization_config", None)
    cfg.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
               vocab_size=512)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg.pop(key, None)
    cfg["intermediate_size"] = 256 if "num_local_experts" in cfg else 512
    if "num_local_experts" in cfg:
        cfg.update(num_local_experts=8, num_experts_per_tok=2, experts_per_token=2)
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:4]
    return ModelArgs.from_config(cfg)


class RandomSource:
    """Every tensor of ``args``' model, random (seeded by name), made where it is loaded."""

    def __init__(self, args: ModelArgs, *, seed: int = 0, fail_after: int | None = None) -> None:
        self.path = Path(f"<random {args.architecture}>")
        self.seed = seed
        self.fail_after = fail_after  # simulate running out of memory after this many layers
        model = families.meta_model(families.hf_config(args.config, where=str(self.path)), torch.float32)
        self._shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def load(self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if self.fail_after is not None and layer >= self.fail_after:
            raise torch.OutOfMemoryError(f"simulated: out of memory loading {name}")
        shape = self._shapes[name]
        device = torch.device(device)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        g = torch.Generator(device=device).manual_seed(self.seed * 7919 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(0.02)  # no float32 copy
