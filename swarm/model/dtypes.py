"""Choosing the serving dtype for a device.

bf16 halves memory and bandwidth, and GPUs run it natively. Many CPUs do not: without AVX512-BF16
or AMX, a bf16 matrix multiply is emulated and slower than fp32, and much slower for the several
rows of a verify chunk (measured on this project's CI CPU, an AVX2 EPYC: one 1536x576 linear took
187 us in bf16 against 124 us in fp32 for one row, 960 us against 338 us for five). So "auto"
means bf16 where a device runs it natively (CUDA sm80+, MPS on macOS 14+, a CPU with AVX512-BF16 or
AMX), else fp16 on a GPU and fp32 on a CPU, and never fp16 for a model that overflows it
(capability.py holds these rules and their reasons).
"""

from __future__ import annotations

import functools

import torch

from swarm.errors import UsageError

NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@functools.cache
def _cpu_flags() -> str:
    """/proc/cpuinfo ("" where there is none: such a CPU is assumed to lack every extension)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_avx512_vnni() -> bool:
    """AVX512-VNNI: int8 dot products that add in int32 (quant_dynamic.py says why that matters)."""
    return "avx512_vnni" in _cpu_flags()


def auto_dtype(device: str | torch.device = "cpu", model_type: str | None = None) -> torch.dtype:
    """What ``--dtype auto`` serves on ``device`` (the device itself is asked: ``cuda:1`` is GPU 1)."""
    from swarm.model import capability

    return capability.auto_dtype(capability.probe(torch.device(device)), model_type)


def resolve_dtype(name: str, device: str | torch.device = "cpu", model_type: str | None = None) -> torch.dtype:
    """``auto``, ``bf16``, ``fp16`` or ``fp32`` -> a torch dtype (UsageError otherwise, and for a
    dtype this device or model cannot serve correctly: fp16 on Gemma, bf16 on an old macOS)."""
    from swarm.model import capability

    if name == "auto":
        return auto_dtype(device, model_type)
    try:
        dtype = NAMES[name]
    except KeyError:
        raise UsageError(f"dtype must be auto, bf16, fp16 or fp32, got {name!r}") from None
    problem = capability.dtype_problem(capability.probe(torch.device(device)), dtype, model_type)
    if problem is not None:
        raise UsageError(f"--dtype {name} on {torch.device(device)}: {problem}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in NAMES.items()}[dtype]
