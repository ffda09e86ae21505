"""Running out of memory, handled: what an out-of-memory error means here, and its test hooks.

An out-of-memory error in a forward (a stage's block, a prefill chunk, the coordinator's head)
fails the requests it was computing, with a clear message (stage_worker.py, coordinator.py):
the caches it half-wrote are dropped, the node keeps serving every other session, the ring is
not re-planned and nobody is blamed (``RequestRefused``, fail code ``refused``). A block that
cannot be loaded (models.py) is answered with :class:`CannotLoad` and the peer lowers its
offer to what it could hold, so the leader's next plan gives it less, with no fault reported.

Tests reach these paths through real processes with two environment variables, read once at
import (a node process inherits them; nothing else sets them):

    SWARM_INJECT_OOM_TOKENS=N       a forward over a chunk of N or more tokens runs out of memory
    SWARM_INJECT_OOM_LOAD_LAYERS=N  loading a block of more than N layers runs out of memory
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

import torch

from swarm.errors import SwarmError

OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)

INJECT_OOM_TOKENS = int(os.environ.get("SWARM_INJECT_OOM_TOKENS", "0") or 0)
INJECT_OOM_LOAD_LAYERS = int(os.environ.get("SWARM_INJECT_OOM_LOAD_LAYERS", "0") or 0)


class CannotLoad(SwarmError):
    """This peer cannot load the block it was planned (out of memory): it says so and offers
    less; the leader plans again without blaming it."""

    exit_code = 7


def check_forward(tokens: int) -> None:
    """Test hook (module doc): an injected out-of-memory error for a chunk this long (callers
    test ``INJECT_OOM_TOKENS`` first, so that a forward makes no call when nothing is injected)."""
    if INJECT_OOM_TOKENS and tokens >= INJECT_OOM_TOKENS:
        raise torch.OutOfMemoryError(f"injected: a forward over {tokens} tokens (SWARM_INJECT_OOM_TOKENS={INJECT_OOM_TOKENS})")


def check_load(layers: int) -> None:
    """Test hook (module doc): an injected out-of-memory error for a block this big."""
    if INJECT_OOM_LOAD_LAYERS and layers > INJECT_OOM_LOAD_LAYERS:
        raise torch.OutOfMemoryError(f"injected: loading {layers} layers (SWARM_INJECT_OOM_LOAD_LAYERS={INJECT_OOM_LOAD_LAYERS})")


# glibc's mallopt parameter for the size from which malloc maps a fresh region (and unmaps it on free)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own default, held fixed


def bounded_heap() -> bool:
    """Hold glibc's mmap threshold at its default, so that freed tensors go back to the system.

    By default glibc raises the threshold to the size of each mapped block freed (up to 32 MB), after
    which blocks that size come from the heap, and a heap gives back only what is free at its top:
    loading a block (one layer's float temporaries freed after each is quantized) left that memory
    resident. Measured on the bundled model, 10 layers in int4 from bf16 safetensors (25 MB kept):
    the process's anonymous memory grew 65-99 MB by default, 26 MB with the threshold fixed (peak
    41 MB: one layer's temporaries, which the budget counts). Setting it also turns glibc's dynamic
    adjustment off. Process-wide, so the composition root calls it once; False where the C library
    is not glibc (musl and macOS return freed large blocks already)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release(device: str = "cpu") -> None:
    """Give back what a failed allocation left behind (the allocator's cached blocks too)."""
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe(exc: BaseException) -> str:
    """One line for an out-of-memory error (a CUDA one is several lines long)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"out of memory ({first[:200]})"


def measured_memory() -> tuple[int | None, int | None]:
    """(VmHWM, VmRSS) of this process in bytes, from /proc/self/status: its peak and current
    resident memory, what ``status`` shows beside the predicted peak; (None, None) without /proc."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    found[key] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None, None
    return found.get("VmHWM"), found.get("VmRSS")


def size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
