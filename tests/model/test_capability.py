"""The capability table: which dtype ``auto`` serves and which weight-only kernel multiplies, as a
pure function of (device capability, dtype, shape), for machines this project has not run on.

The rows are the facts in capability.py's docstring (torch 2.13's kernels and the field's
failures); the probe tests fake torch's answers (swarm.testing.hardware) to show the *node's own*
device is asked, and the kernel check falls back to ``dequant`` when a device's kernel is wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.errors import UsageError
from swarm.model import capability
from swarm.model.capability import Capability, auto_dtype, cpu, cuda, int4_kernel, int8_kernel, mps
from swarm.model.dtypes import resolve_dtype
from swarm.testing.hardware import fake_hardware

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# device, auto dtype (a Llama), auto dtype (a Gemma), int8 kernel and int4 kernel (4096x4096) in the auto dtype
TABLE: list[tuple[Capability, torch.dtype, torch.dtype, str, str]] = [
    (cuda(7, 5), FP16, FP32, "dequant", "dequant"),  # 2080 Ti / T4: bf16 only emulated; tinygemm needs sm80
    (cuda(8, 0), BF16, BF16, "dequant", "int4pack_cuda"),  # A100: CUDA int8pack is naive -> cuBLAS
    (cuda(8, 9), BF16, BF16, "dequant", "int4pack_cuda"),  # 4090 / L4
    (mps(True), BF16, BF16, "int8pack", "int4pack_cuda"),  # Apple silicon, macOS 14+: MPS's own kernels
    (mps(False), FP16, FP32, "int8pack", "int4pack_cuda"),  # older macOS: no bf16; Gemma overflows fp16
    (cpu(True), BF16, BF16, "int8pack", "int4pack_cpu"),  # AVX512-BF16 / AMX
    (cpu(False), FP32, FP32, "dequant", "dequant"),  # AVX2: packed kernels are scalar in fp32
]


@pytest.mark.parametrize(("cap", "llama", "gemma", "i8", "i4"), TABLE, ids=[row[0].label for row in TABLE])
def test_the_table(cap: Capability, llama: torch.dtype, gemma: torch.dtype, i8: str, i4: str) -> None:
    assert auto_dtype(cap, "llama") == llama
    assert auto_dtype(cap, "gemma3_text") == gemma
    assert int8_kernel(cap, llama) == i8
    assert int4_kernel(cap, llama, 4096, 4096) == i4


@pytest.mark.parametrize("cap", [cuda(7, 5), cuda(8, 0), cuda(8, 9), mps(True), mps(False), cpu(True), cpu(False)])
def test_packed_kernels_only_where_their_dtype_and_tiles_fit(cap: Capability) -> None:
    # fp32 activations never take a packed int4 kernel; neither do shapes off its tiles
    assert int4_kernel(cap, FP32, 4096, 4096) == "dequant"
    assert int4_kernel(cap, BF16, 4100, 4096) == "dequant"  # N not a multiple of 8 (or 16 on a CPU)
    if cap.kind != "cpu":
        assert int4_kernel(cap, BF16, 4096, 4128) == "dequant"  # K not a multiple of 64
    # the CUDA int4 kernel wants bf16 activations, even on sm80+
    assert int4_kernel(cuda(8, 9), FP16, 4096, 4096) == "dequant"


def test_the_gpu_asked_is_the_nodes_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node on cuda:1 (an A100 beside a T4 at cuda:0) serves bf16 with the int4 kernel."""
    fake_hardware(monkeypatch, cuda=2, sm=[(7, 5), (8, 0)])
    capability._capability.cache_clear()
    try:
        assert capability.device_capability(torch.device("cuda", 1)) == cuda(8, 0)
        assert capability.device_capability(torch.device("cuda")) == cuda(7, 5)  # cuda means cuda:0
        assert resolve_dtype("auto", torch.device("cuda", 1)) == BF16
        assert resolve_dtype("auto", torch.device("cuda", 0)) == FP16
        assert resolve_dtype("auto", torch.device("cuda", 0), "gemma3_text") == FP32
    finally:
        capability._capability.cache_clear()


def test_bf16_emulation_does_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=1, sm=[(7, 5)])
    assert torch.cuda.is_bf16_supported()  # torch's default answer counts emulation...
    capability._capability.cache_clear()
    try:
        assert resolve_dtype("auto", torch.device("cuda", 0)) == FP16  # ...ours does not
    finally:
        capability._capability.cache_clear()


def test_fp16_on_gemma_is_refused_with_a_reason() -> None:
    with pytest.raises(UsageError, match="gemma3_text overflows fp16"):
        resolve_dtype("fp16", "cpu", "gemma3_text")
    assert resolve_dtype("fp16", "cpu", "llama") == FP16


def test_a_kernel_that_fails_its_check_on_the_device_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU the table's packed kernel is checked once on the device itself; failing -> dequant."""
    calls: list[tuple[str, str]] = []

    def check(device: str, kernel: str, dtype: torch.dtype) -> bool:
        calls.append((device, kernel))
        return False

    monkeypatch.setattr(capability, "kernel_works", check)
    monkeypatch.setattr(capability, "device_capability", lambda d: mps(True))
    assert capability.choose_kernel("int8", torch.device("meta"), BF16, 64, 128) == "dequant"
    assert capability.choose_kernel("int4", torch.device("meta"), BF16, 64, 128) == "dequant"
    assert calls == [("meta", "int8pack"), ("meta", "int4pack_cuda")]


def test_the_check_runs_the_kernel_against_the_dequantized_product() -> None:
    assert capability.kernel_works("cpu", "int8pack", BF16)
    assert capability.kernel_works("cpu", "int4pack_cpu", BF16)
    assert not capability.kernel_works("cpu", "int4pack_cuda", BF16)  # no CUDA kernel in a CPU build


def test_a_node_on_a_pre_ampere_gpu_serves_gemma_in_fp32_and_llama_in_fp16(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The node's settings resolve ``--dtype auto`` knowing the model: fp16 would overflow Gemma."""
    import types

    from swarm.node.settings import settings_from_mapping
    from swarm.testing.hf_checkpoints import write_family_checkpoint

    manifest = types.SimpleNamespace(swarm_id="s", secret=types.SimpleNamespace(value=b"k" * 32), revoked=(),
                                     quant="none", bootstrap=(), context_tokens=2048, kv_cache="auto")
    fake_hardware(monkeypatch, cuda=1, sm=[(7, 5)])
    capability._capability.cache_clear()
    try:
        for family, want in (("gemma3", FP32), ("llama", FP16)):
            model = write_family_checkpoint(tmp_path / family, family)
            s = settings_from_mapping({"device": "cuda", "model_dir": str(model)}, seed=b"x" * 32, manifest=manifest)
            assert s.dtype == want, family
    finally:
        capability._capability.cache_clear()


def test_join_resolves_auto_knowing_the_model_on_a_pre_ampere_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``join``'s own settings (not only a settings file's) pass the model to ``--dtype auto``."""
    from swarm.cli.join import node_settings_of
    from swarm.manifest.manifest import new_manifest
    from swarm.testing.hf_checkpoints import write_family_checkpoint

    fake_hardware(monkeypatch, cuda=1, sm=[(7, 5)])
    capability._capability.cache_clear()
    try:
        for family, want in (("gemma3", FP32), ("llama", FP16)):
            model = write_family_checkpoint(tmp_path / family, family)
            manifest = new_manifest(swarm_name="t", issuer=b"i" * 32)
            s = node_settings_of(manifest, b"x" * 32, ["/ip4/127.0.0.1/tcp/0"], 1 << 30, model,
                                 dtype="auto", device="cuda", threads=1, mdns=False, relay=False)
            assert s.dtype == want, family
    finally:
        capability._capability.cache_clear()


SMOL = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # the bundled SmolLM2's (N, K)


@pytest.mark.parametrize(
    ("cap", "dtype", "stored", "want"),
    [
        (cpu(True), BF16, "int4", "int4"),  # AVX512-BF16 / AMX: a Q4 GGUF keeps int4 (torch's packed kernel)
        (cpu(True), BF16, "int8", "int8"),  # a Q8 / Q5 / Q6 one keeps int8
        (cpu(True), BF16, "none", "none"),  # a float checkpoint is never made coarser
        (cpu(True), FP32, "int4", "none"),  # --dtype fp32: the packed kernels are scalar there
        (cpu(False), FP32, "int4", "none"),  # AVX2, auto = fp32: a dequantizing layer is slower than dense
        (cpu(False), FP32, "int8", "none"),
        (cpu(False), BF16, "int4", "int4"),  # an explicit --dtype bf16 gets the kernel on any CPU
        (cuda(8, 9), BF16, "int4", "int4"),  # tinygemm
        (cuda(8, 9), BF16, "int8", "none"),  # CUDA's int8pack is naive; a dequantizing layer is not kept
        (cuda(7, 5), FP16, "int4", "none"),  # pre-Ampere: no int4 kernel
        (mps(True), BF16, "int8", "int8"),
    ],
)
def test_auto_quant_keeps_the_stored_format_only_where_a_packed_kernel_runs_it(
    cap: Capability, dtype: torch.dtype, stored: str, want: str
) -> None:
    assert capability.auto_quant(cap, dtype, stored, SMOL) == want


def test_auto_quant_needs_every_shape_on_the_kernels_tiles() -> None:
    # one weight off the CPU int4 kernel's N % 16 would dequantize on every call: the model stays dense
    assert capability.auto_quant(cpu(True), BF16, "int4", [*SMOL, (1000, 576)]) == "none"
    assert capability.auto_quant(cpu(True), BF16, "int4", []) == "none"
    assert capability.auto_quant(cpu(True), BF16, "int8", [(1000, 576)]) == "int8"  # int8: per channel, any N


X86_VNNI = cpu(True, fbgemm=True, vnni=True)  # this project's AVX512-BF16/VNNI EPYC
X86_AVX2 = cpu(False, fbgemm=True)  # an AVX2-only x86-64 (fbgemm runs, no VNNI)
ARM = cpu(False)  # aarch64 (no fbgemm in torch's build) or a torch that dropped it


@pytest.mark.parametrize(
    ("cap", "dtype", "stored", "want", "kernel"),
    [
        (X86_VNNI, BF16, "int8", "int8", "fbgemm_dynamic"),  # a Q8_0 head (both bundled models): 2.6x int8pack
        (X86_VNNI, FP32, "int8", "int8", "fbgemm_dynamic"),  # fbgemm takes fp32 activations: fp32 serving too
        (X86_AVX2, FP32, "int8", "int8", "fbgemm_dynamic"),  # auto = fp32 there
        (cpu(True), BF16, "int8", "int8", "int8pack"),  # no fbgemm: torch's packed kernel, faster than dense
        (ARM, BF16, "int8", "int8", "int8pack"),  # an explicit --dtype bf16 gets the kernel on any CPU
        (ARM, FP32, "int8", "none", "dequant"),  # fp32 without fbgemm: int8pack is scalar there
        (X86_VNNI, BF16, "int4", "none", "fbgemm_dynamic"),  # an int4 head: not measured, stays dense
        (X86_VNNI, BF16, "none", "none", "fbgemm_dynamic"),  # a float head is never made coarser
        (cuda(8, 9), BF16, "int8", "none", "dequant"),  # CUDA's int8pack is naive
        (mps(True), BF16, "int8", "int8", "int8pack"),
    ],
)
def test_auto_head_quant_keeps_an_int8_head_only_where_an_int8_kernel_runs_it(
    cap: Capability, dtype: torch.dtype, stored: str, want: str, kernel: str
) -> None:
    assert capability.auto_head_quant(cap, dtype, stored) == want
    assert capability.head_kernel(cap, dtype) == kernel


def test_the_status_table_names_the_heads_kernel() -> None:
    assert capability.table(X86_VNNI)["head_int8"] == "fbgemm_dynamic"
    assert capability.table(cuda(8, 9))["head_int8"] == "dequant"


def test_fbgemm_quantizes_activations_to_7_bits_only_without_vnni() -> None:
    # without VNNI fbgemm adds pairs of uint8 x int8 products in int16: 2 * 255 * 127 saturates it
    assert capability.dynamic_reduce_range(X86_AVX2) is True
    assert capability.dynamic_reduce_range(cpu(True, fbgemm=True)) is True  # AVX512 without VNNI
    assert capability.dynamic_reduce_range(X86_VNNI) is False


def test_the_probe_sees_fbgemm_where_torch_lists_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from swarm.model import quant_dynamic

    here = capability.probe(torch.device("cpu"))
    assert here.fbgemm == ("fbgemm" in torch.backends.quantized.supported_engines)
    monkeypatch.setattr(quant_dynamic, "fbgemm_available", lambda: False)  # a torch without it
    assert capability.probe(torch.device("cpu")).fbgemm is False
    assert capability.head_kernel(capability.probe(torch.device("cpu")), BF16) == "int8pack"


def test_choose_quant_asks_the_device_kernel_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capability, "device_capability", lambda d: mps(True))
    monkeypatch.setattr(capability, "kernel_works", lambda device, kernel, dtype: kernel != "int4pack_cuda")
    assert capability.choose_quant("int4", torch.device("meta"), BF16, SMOL) == "none"
    assert capability.choose_quant("int8", torch.device("meta"), BF16, SMOL) == "int8"
