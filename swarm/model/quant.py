"""Weight-only quantization of a decoder block, kept compact in memory.

Theory of operation
-------------------
``quantize_block(module, "int8" | "int4" | "mxfp4")`` walks ``module`` and replaces every
``nn.Linear`` with a :class:`QuantLinear` (not under mxfp4: linears stay dense, as gpt-oss ships
them), and every MoE experts module of transformers (fused 3-D expert weights) with a
:class:`~swarm.model.quant_experts.QuantExperts`; both hold their weights in 8 or 4 bits
and multiply with torch's own packed weight-only kernels (formats and kernels:
quant_formats.py). It knows nothing else about the layer's structure, so it works on the
hand-written layers of ``llama_layers.py`` and on transformers' decoder layers alike; a runtime
calls it once per layer, right after that layer's weights are loaded, so a stage never holds more
than one layer in the serving dtype beyond its compact size. Norms, biases, routers, embeddings
and the LM head stay in the serving dtype.

The planner's budget (:func:`layer_bytes_each`) counts the same things per layer from the meta
model: every quantizable weight at its compact size, everything else in the serving dtype; a test
holds it equal to the bytes a loaded stage keeps resident.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from swarm.errors import ConfigError
from swarm.model.config import ModelArgs
from swarm.model.quant_experts import QuantExperts, experts_paths
from swarm.model.quant_formats import (
    INT4_GROUP,
    INT8_ROWS,
    Int4Groups,
    Packed,
    int4_from_float,
    int4_group_for,
    int8_from_float,
    pack,
    packed_nbytes,
)

__all__ = [
    "INT4_GROUP",
    "QUANTS",
    "Int4Groups",
    "QuantExperts",
    "QuantLinear",
    "check_quant",
    "int4_from_float",
    "int4_group_for",
    "int8_from_float",
    "layer_bytes",
    "layer_bytes_each",
    "layer_compact_bytes_each",
    "layer_load_bytes",
    "linear_paths",
    "quantize_block",
]

QUANTS = ("none", "int8", "int4", "mxfp4")
# formats that keep only a MoE layer's experts compact (nn.Linear layers stay in the serving dtype:
# gpt-oss, released in MXFP4, keeps its attention and router in bf16 too)
EXPERTS_ONLY = frozenset({"mxfp4"})


def check_quant(name: object, where: str = "quant") -> str:
    """``name`` if it is a quantization this program serves, else a ConfigError naming the choices."""
    if not isinstance(name, str) or name not in QUANTS:
        raise ConfigError(f"{where}: unknown quantization {name!r}; choose one of {', '.join(QUANTS)}")
    return name


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear`` (int8 per channel or int4 per group; quant_formats.py).

    The compact weight lives in buffers ``qweight`` and ``scales`` (so ``parameters()`` of a
    quantized block still yields the serving dtype of its norms); ``nbytes`` counts them.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, layout: Packed, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.layout = layout
        self.in_features, self.out_features = layout.k, layout.n
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().to(device=qweight.device, dtype=layout.dtype))

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def kernel(self) -> str:
        return self.layout.kernel

    @property
    def group(self) -> int:
        return self.layout.group

    @classmethod
    def int8(cls, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        return cls(*Packed.int8(w, dtype, device), bias)

    @classmethod
    def int4(cls, g: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> QuantLinear:
        return cls(*Packed.int4(g, dtype, device), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (T, K)
        if x2.dtype != self.layout.dtype:  # packed in another dtype than the serving one (autotune.py)
            x2 = x2.to(self.layout.dtype)
        y = self.layout.matmul(x2, self.qweight, self.scales)  # (T, N)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)  # (..., N)

    def dequantized(self) -> torch.Tensor:
        """The weight (N, K) the kernel multiplies by, in float32 (for tests and the fallback path)."""
        return self.layout.dequantized(self.qweight, self.scales)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        g = f", group={self.group}" if self.kind == "int4" else ""
        return f"{self.kind}, in={self.in_features}, out={self.out_features}{g}, kernel={self.kernel}"


def linear_paths(module: nn.Module) -> list[str]:
    """Dotted names of the ``nn.Linear`` modules inside ``module`` (what quantize_block replaces)."""
    return [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def quantize_block(
    module: nn.Module,
    quant: str,
    *,
    dtype: torch.dtype | None = None,
    group: int = INT4_GROUP,
    given: Mapping[str, Int4Groups] | None = None,
    device: torch.device | None = None,
    kernel_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` and every experts module of ``module`` (in place) by its compact
    form; returns ``module``.

    ``given`` maps a linear's dotted name to int4 groups read straight from a checkpoint (GGUF
    Q4_*): that layer's own weight is then ignored (it may be on the meta device). ``dtype`` is
    the serving dtype (default: each weight's own dtype). ``device`` is where the compact weights
    go and which device's kernels they use (default: where each loaded weight already is); a
    layer given as int4 groups has no loaded weight to tell, and its groups come from numpy on the
    CPU, so a stage on a GPU must pass its device. ``kernel_dtype`` packs the linears in another
    dtype than the serving one (bf16, so that torch's packed kernels apply under fp32 activations:
    each call rounds its input to bf16; chosen by measurement, autotune.py); the experts of a MoE
    layer keep the serving dtype. ``quant == "none"`` changes nothing.
    """
    check_quant(quant)
    if quant == "none":
        return module
    given = dict(given or {})
    for path in [] if quant in EXPERTS_ONLY else linear_paths(module):
        lin = module.get_submodule(path)
        assert isinstance(lin, nn.Linear)
        dt = kernel_dtype or dtype or lin.weight.dtype
        bias = lin.bias
        if path in given:
            if quant != "int4":
                raise ConfigError(f"{path}: int4 groups given for a {quant} block")
            new = QuantLinear.int4(given.pop(path), bias, dt, device or _device_of(lin))
        elif lin.weight.device.type == "meta" and (device is None or device.type != "meta"):
            raise ConfigError(f"{path}: weight not loaded (on the meta device) and no compact form given")
        else:
            new = QuantLinear(*pack(lin.weight.detach(), quant, dt, device or lin.weight.device, group), bias)
        module.set_submodule(path, new)
        del lin
    if given:
        raise ConfigError(f"int4 groups given for layers that are not nn.Linear here: {sorted(given)}")
    for path in experts_paths(module):
        if not path:
            raise ConfigError("quantize_block: pass the layer that holds the experts, not the experts module itself")
        experts = module.get_submodule(path)
        module.set_submodule(path, QuantExperts.from_experts(experts, quant, dtype=dtype, group=group, device=device))
    return module


def _device_of(lin: nn.Linear) -> torch.device:
    """Where a linear's loaded tensors are (its weight, else its bias); ConfigError if neither is."""
    for t in (lin.weight, lin.bias):
        if t is not None and t.device.type != "meta":
            return t.device
    raise ConfigError("quantize_block: a linear layer given as int4 groups needs device= (none of its tensors is loaded)")


def block_nbytes(module: nn.Module) -> int:
    """Resident bytes of a block's weights: parameters plus buffers (compact weights included)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# ------------------------------------------------------------------------------ planning
def layer_bytes_each(args: ModelArgs, quant: str, dtype_bytes: int) -> list[int]:
    """Resident bytes of each decoder layer's weights under ``quant`` (the planner's budget).

    Every quantizable weight of a layer (its nn.Linear modules, and every expert of each fused
    experts projection) is counted at its compact size; the rest (norms, biases, routers) stays
    in the serving dtype. Under an experts-only format (mxfp4) the linear layers (count 1) do too.
    """
    check_quant(quant)
    out = []
    for params, weights in zip(args.layer_bytes_each(dtype_bytes), args.quantizable_shapes(), strict=True):
        total = params
        for count, n, k in weights:
            if quant in EXPERTS_ONLY and count == 1:
                continue  # an nn.Linear: dense (an experts projection counts its experts, > 1)
            total += count * (linear_bytes(n, k, quant, dtype_bytes) - n * k * dtype_bytes)
        out.append(total)
    return out


def layer_compact_bytes_each(args: ModelArgs, quant: str) -> list[int]:
    """The part of each decoder layer's resident bytes under ``quant`` that is the same at every
    serving width: its packed integers (int8 and int4 codes; all of an MXFP4 weight) and any
    tensor a family keeps in float32 whatever it serves in (a router). The rest (scales, zeros,
    norms, biases) is as wide as the serving dtype, so a layer's bytes are affine in the width
    ``w``: ``compact + rest_at_2 * w / 2``, and the compact part is what the line meets at w = 0
    (the planner's ModelSpec.at_width). 0 where every byte widens (a dense llama layer)."""
    return [2 * at2 - at4 for at2, at4 in zip(layer_bytes_each(args, quant, 2), layer_bytes_each(args, quant, 4), strict=True)]


# What quantizing one float weight (N, K) holds at most besides it, per weight, in bytes
# (quant_formats.int4_from_float: two float32 temporaries of its arithmetic at once and the one-byte
# integers, 2 x 4 + 1, and a float32 copy of the weight first where it is narrower; int8_from_float
# the same over at most INT8_ROWS rows at a time, its integers preallocated whole). Measured with
# torch's profiler on the bundled model, one layer from the bf16 safetensors, beyond the dense
# layer: 1.3 (int4, fp32), 1.5 (int8, fp32), 2.8 (int4, bf16) and 3.0 (int8, bf16) float32 copies
# of its largest weight (tests/node/test_quant_budget.py holds the bound).
QUANTIZE_BYTES_PER_WEIGHT = 9
FLOAT_COPY_BYTES_PER_WEIGHT = 4


def layer_load_bytes(args: ModelArgs, quant: str, dtype_bytes: int) -> int:
    """The most that loading one decoder layer holds at once beyond the compact layers before it
    (the load-time peak a block's budget adds once: planner/budget.py): the layer in the serving
    dtype, and where it is quantized from float weights (int8, int4) the temporaries of
    quantizing its largest weight (QUANTIZE_BYTES_PER_WEIGHT) and, for a MoE projection, its
    experts' compact weights once more while they are stacked into one tensor. An upper bound
    for a checkpoint that stores int4 groups (GGUF Q4_*), which are repacked without a float copy."""
    dense = layer_bytes(args, "none", dtype_bytes)
    if quant not in ("int8", "int4"):
        return dense
    per_weight = QUANTIZE_BYTES_PER_WEIGHT - 1 + (FLOAT_COPY_BYTES_PER_WEIGHT if dtype_bytes < 4 else 0)
    worst = 0
    for weights in args.quantizable_shapes():
        for count, n, k in weights:
            rows = min(n, INT8_ROWS) if quant == "int8" else n
            temp = rows * k * per_weight + n * k  # the float temporaries, and the integers whole
            if count > 1:
                temp += count * linear_bytes(n, k, quant, dtype_bytes)
            worst = max(worst, temp)
    return dense + worst


def layer_bytes(args: ModelArgs, quant: str, dtype_bytes: int) -> int:
    """Resident bytes of the largest decoder layer under ``quant`` (see :func:`layer_bytes_each`)."""
    return max(layer_bytes_each(args, quant, dtype_bytes))


def linear_bytes(n: int, k: int, quant: str, dtype_bytes: int, group: int = INT4_GROUP) -> int:
    """Bytes one (N, K) weight costs resident under ``quant`` (bias not included)."""
    check_quant(quant)
    return packed_nbytes(n, k, quant, dtype_bytes, group)
