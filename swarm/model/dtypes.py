"""Choosing the serving dtype for a device.

bf16 halves memory and bandwidth, and GPUs run it natively. Many CPUs do not: without AVX512-BF16
or AMX, a bf16 matrix multiply is emulated and slower than fp32, and much slower for the several
rows of a verify chunk (measured on this project's CI CPU, an AVX2 EPYC: one 1536x576 linear took
187 us in bf16 against 124 us in fp32 for one row, 960 us against 338 us for five). So "auto"
means bf16 on CUDA (fp16 where bf16 is unsupported), fp16 on MPS, and on a CPU bf16 only when it
has native bf16 instructions, else fp32.
"""

from __future__ import annotations

import functools

import torch

from swarm.errors import UsageError

NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dev.type == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """``auto``, ``bf16``, ``fp16`` or ``fp32`` -> a torch dtype (UsageError otherwise)."""
    if name == "auto":
        return auto_dtype(device)
    try:
        return NAMES[name]
    except KeyError:
        raise UsageError(f"dtype must be auto, bf16, fp16 or fp32, got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in NAMES.items()}[dtype]
