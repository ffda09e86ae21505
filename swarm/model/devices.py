"""Which device a peer computes on, what it is called, and how much memory it can offer there.

A peer names its device with ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (``--device`` or
``node.device`` in the config file). ``auto`` takes the first CUDA GPU, then Apple's MPS, else the
CPU. Naming a device this machine does not have is a UsageError that names it (exit 2): a peer
that silently fell back to its CPU would be planned as a GPU and slow the whole ring.

Memory offered for layers (``--memory auto``):

- CUDA: the device's free memory (``torch.cuda.mem_get_info``, measured after the CUDA context
  exists, so the context is already subtracted) minus a margin of ``GPU_MARGIN_FIXED`` + 5% of the
  card. The planner budgets the weights and each layer's KV cache for the context length itself
  (planner/spec.py); the margin covers what it does not count: activations of a prefill chunk,
  cuBLAS workspaces, the caching allocator's fragmentation, and a display or another process
  growing a little on the same card.
- MPS: unified memory, so the same as the CPU.
- CPU: half of the memory the kernel reports available (the rest is the OS, page cache, Python).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
from pathlib import Path

import torch

from swarm.errors import UsageError

DEVICE_NAMES = "auto, cpu, cuda, cuda:N or mps"
_DEVICE = re.compile(r"(auto|cpu|mps|cuda)(?::(\d+))?")
GPU_MARGIN_FIXED = 1 << 30  # bytes kept free on a GPU besides 5% of its memory (see the docstring)
GPU_MARGIN_FRACTION = 0.05
GIB = 1 << 30


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str, *, where: str = "--device") -> torch.device:
    """``auto``/``cpu``/``cuda``/``cuda:N``/``mps`` -> a device this machine has (UsageError
    otherwise, naming the device and ``where`` it was asked for: the flag or the config file)."""
    text = name.strip().lower()
    m = _DEVICE.fullmatch(text)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise UsageError(f"{where} {name!r}: expected {DEVICE_NAMES}")
    kind = m.group(1)
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
            raise UsageError(
                f"{where} {text}: no CUDA device on this machine (torch {torch.__version__} has {built}); "
                "use --device cpu, or auto to take what there is"
            )
        index = int(m.group(2) or 0)
        count = torch.cuda.device_count()
        if index >= count:
            raise UsageError(f"{where} {text}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return torch.device("cuda", index)
    if kind == "mps" and not _mps_available():
        raise UsageError(f"{where} {text}: MPS (Apple silicon) is not available here; use --device cpu or auto")
    return torch.device(kind)


def device_label(device: torch.device) -> str:
    """The canonical spelling (``cuda:1``, ``cpu``) that travels in adverts and receipts."""
    return f"cuda:{device.index or 0}" if device.type == "cuda" else device.type


def describe_device(device: torch.device) -> tuple[str, str]:
    """(kind, name) for adverts, status and receipts: the GPU's name and memory, or the CPU model."""
    if device.type == "cuda":
        index = device.index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        return device_label(device), f"{torch.cuda.get_device_name(index)}, {total / GIB:.0f} GiB"[:128]
    if device.type == "mps":
        return "mps", "Apple silicon (unified memory)"
    return "cpu", cpu_name()[:128]


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def host_available_bytes() -> int:
    """What the kernel says is available (MemAvailable), else physical memory, else 0."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0


def gpu_margin_bytes(total: int) -> int:
    return GPU_MARGIN_FIXED + int(GPU_MARGIN_FRACTION * total)


def auto_memory_bytes(device: torch.device) -> int:
    """The memory ``--memory auto`` offers for layers on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free) - gpu_margin_bytes(int(total)))
    return host_available_bytes() // 2


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (a timing on an accelerator must, or it times the launch only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
