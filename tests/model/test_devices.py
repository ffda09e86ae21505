"""Device choice, naming and the memory a peer offers, with CUDA and MPS availability faked.

This machine has neither, so the accelerator paths run against monkeypatched torch.cuda /
torch.backends.mps answers: what is proven here is our logic (which device ``auto`` picks, the
errors, the margin), not that a real GPU computes correctly; benchmarks/gpu_check.py is for that.
"""

from __future__ import annotations

import pytest
import torch

from swarm.errors import UsageError
from swarm.model import devices
from swarm.model.devices import (
    GIB,
    auto_memory_bytes,
    describe_device,
    device_label,
    gpu_margin_bytes,
    resolve_device,
)
from swarm.model.dtypes import auto_dtype
from swarm.testing.hardware import fake_hardware


@pytest.mark.parametrize(
    ("cuda", "mps", "want"),
    [(0, False, "cpu"), (1, False, "cuda:0"), (2, True, "cuda:0"), (0, True, "mps")],
)
def test_auto_prefers_cuda_then_mps_then_cpu(monkeypatch: pytest.MonkeyPatch, cuda: int, mps: bool, want: str) -> None:
    fake_hardware(monkeypatch, cuda=cuda, mps=mps)
    assert device_label(resolve_device("auto")) == want
    assert device_label(resolve_device(" AUTO ")) == want


def test_explicit_devices_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=2, mps=True)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert device_label(resolve_device("cuda")) == "cuda:0"
    assert resolve_device("mps") == torch.device("mps")


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:-1", "cpu:0", "mps:1", "cuda 0", ""])
def test_bad_device_names_are_usage_errors(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    fake_hardware(monkeypatch, cuda=1)
    with pytest.raises(UsageError, match="expected auto, cpu, cuda, cuda:N or mps") as e:
        resolve_device(name)
    assert e.value.exit_code == 2


def test_a_missing_device_is_a_usage_error_that_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=0, mps=False)
    for name in ("cuda", "cuda:0", "mps"):
        with pytest.raises(UsageError, match=f"--device {name}: ") as e:
            resolve_device(name)
        assert e.value.exit_code == 2
    fake_hardware(monkeypatch, cuda=2)
    with pytest.raises(UsageError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_gpu_offer_is_free_device_memory_less_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=1, free=20 * GIB, total=24 * GIB)
    offer = auto_memory_bytes(torch.device("cuda", 0))
    assert offer == 20 * GIB - gpu_margin_bytes(24 * GIB)
    assert offer == 20 * GIB - GIB - int(0.05 * 24 * GIB)  # ~17.8 GiB of a 24 GiB card with 20 free
    fake_hardware(monkeypatch, cuda=1, free=GIB // 2, total=24 * GIB)  # nearly full card: offers nothing
    assert auto_memory_bytes(torch.device("cuda", 0)) == 0


def test_cpu_and_mps_offer_half_of_available_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=1, free=80 * GIB, total=80 * GIB)  # a GPU present changes nothing for cpu
    monkeypatch.setattr(devices, "host_available_bytes", lambda: 10 * GIB)
    assert auto_memory_bytes(torch.device("cpu")) == 5 * GIB
    assert auto_memory_bytes(torch.device("mps")) == 5 * GIB


def test_describe_names_the_gpu_and_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=2, total=24 * GIB)
    assert describe_device(torch.device("cuda", 1)) == ("cuda:1", "NVIDIA GeForce RTX 4090 #1, 24 GiB")
    kind, name = describe_device(torch.device("cpu"))
    assert kind == "cpu" and 0 < len(name) <= 128


def test_auto_dtype_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=1, bf16=True)
    assert auto_dtype(resolve_device("auto")) == torch.bfloat16
    fake_hardware(monkeypatch, cuda=1, bf16=False)  # e.g. a Turing card: fp16
    assert auto_dtype(resolve_device("auto")) == torch.float16
    fake_hardware(monkeypatch, cuda=0, mps=True)  # macOS 14+: native bf16
    assert auto_dtype(resolve_device("auto")) == torch.bfloat16
    fake_hardware(monkeypatch, cuda=0, mps=True, macos14=False)
    assert auto_dtype(resolve_device("auto")) == torch.float16
