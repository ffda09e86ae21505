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

import gc
import os

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
