"""Faked accelerators: make torch report CUDA GPUs and MPS that this machine does not have.

For tests of device choice, naming and memory offers (swarm.model.devices) on CPU-only machines.
Only torch's *answers* are faked; nothing can compute on the pretend devices.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import pytest

GIB = 1 << 30


def fake_hardware(monkeypatch: pytest.MonkeyPatch, *, cuda: int = 0, mps: bool = False,
                  free: int = 20 * GIB, total: int = 24 * GIB, bf16: bool = True,
                  sm: list[tuple[int, int]] | None = None, macos14: bool = True) -> None:
    """Pretend this machine has ``cuda`` NVIDIA GPUs (each with ``free`` of ``total`` bytes free;
    GPU i of compute capability ``sm[i]``, by default sm89 with ``bf16`` and sm75 without) and,
    with ``mps``, Apple's MPS (on macOS 14 or later with ``macos14``)."""
    caps = sm or [(8, 9) if bf16 else (7, 5)] * cuda

    def capability(device: str | int | torch.device | None = None) -> tuple[int, int]:
        index = device if isinstance(device, int) else (torch.device(device).index or 0) if device is not None else 0
        return caps[index]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    # torch's own answer counts emulation (True on sm75) unless including_emulation=False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or caps[0] >= (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: macos14 or major < 14)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"NVIDIA GeForce RTX 4090 #{i}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=total))

    def mem_get_info(device: str | int | torch.device | None = None) -> tuple[int, int]:
        dev = torch.device(device) if device is not None else torch.device("cuda", 0)
        if dev.type != "cuda" or (dev.index or 0) >= cuda:
            raise RuntimeError(f"fake mem_get_info: no such device {dev}")
        return free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
