"""What a device may compute with: dtypes and weight-only kernels, by capability, not by speed.

Theory of operation
-------------------
Choosing *fast* settings is a measurement (threads, compiled kernels: the stage-speed work);
choosing *correct* ones is a rule. This module holds the rules as pure functions of a
:class:`Capability` (device kind, CUDA compute capability, native bf16), the serving dtype and the
weight's shape, so that a table test can state them for machines this project has never run on
(a 2080 Ti, an L4, a Mac) and :func:`probe` is the only function that looks at real hardware.

The rules, and the fact behind each:

- ``torch.cuda.is_bf16_supported()`` counts emulation: on sm75 (2080 Ti, T4) it says True and bf16
  then runs emulated, slowly. Native bf16 is ``including_emulation=False``, i.e. sm80+.
- The CUDA int4 kernel (``_weight_int4pack_mm``, "tinygemm") needs sm80+ and bf16 activations,
  N a multiple of 8 and K of 64 (its tiles); anywhere else the int4 weight is dequantized per call.
- CUDA's ``_weight_int8pack_mm`` is a naive kernel; dequantize-then-cuBLAS is allowed on every
  CUDA device and is what int8 uses there (``dequant``: int8 weight times scales in one linear).
- MPS has its own ``_weight_int8pack_mm`` and ``_weight_int4pack_mm``; they are used there, each
  checked once on the node's own device against the dequantized product (:func:`kernel_works`),
  because which dtypes and shapes a given macOS/torch accepts is not documented well enough to
  trust a table alone.
- fp16 overflows on Gemma-class models (embeddings scaled by sqrt(hidden), large residuals): a
  NaN from an honest Mac then looks like a faulty peer. ``auto`` never picks fp16 for them: bf16
  where it is native, else fp32.
- On a CPU, bf16 is native only with AVX512-BF16 or AMX (dtypes.py has the measurement); the CPU's
  packed kernels are used with bf16 activations only (quant_formats.py has the measurement;
  re-measured with torch 2.13 on an AVX512-BF16 EPYC: fp32 activations take 1.8 ms through a
  1536x576 int4 weight and 0.89 ms through int8, against 77 us dense fp32 and 49 us int4 in bf16).
- ``--quant auto`` (:func:`auto_quant`) keeps a checkpoint's own compact format where this device
  multiplies by it with a packed kernel at the serving dtype, and holds it dense otherwise: it
  never makes a model coarser than it was stored (a Q4 GGUF is served in int4, a Q8 or Q5/Q6 one
  in int8, a float checkpoint dense), and never picks a layer that dequantizes on each call, which
  is slower than the dense one it replaces (measured on the bundled SmolLM2, 1 thread, AVX512-BF16:
  bf16 int4pack 35 tok/s, int8pack 26, dense bf16 21, dense fp32 18.5).
- The LM head likewise (:func:`auto_head_quant`): held int8 where the checkpoint stores it in 5 to
  8 bits (both bundled GGUFs tie it to a Q8_0 embedding) and an int8 kernel runs it; it is the
  largest single matrix of a small model (Gemma-3-270M: 262144x640). On a CPU where torch has
  fbgemm (x86-64) that kernel is fbgemm's dynamic int8 linear (:func:`head_kernel`,
  quant_dynamic.py: 2.2-2.6x int8pack's speed here, the activation quantized to 8 bits per call, 7
  without AVX512-VNNI), at any serving dtype; elsewhere int8pack at bf16. A swarm whose invite
  quantizes the layers holds its coordinator's head the same way where it serves narrower than fp32
  (:func:`swarm_head_quant`: the bundled model's head 7.0 -> 2.0 ms a token, Gemma-3-270M's 41.5
  -> 12.1 ms, as above); a dense swarm's head, and an fp32 coordinator's, stay dense.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# model_type values whose activations overflow fp16 (their published configs; transformers' names)
FP16_OVERFLOWS = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text"})


@dataclass(frozen=True)
class Capability:
    """What the rules need to know about one device."""

    kind: str  # "cpu" | "cuda" | "mps" | "meta" (shapes only: tests place a stage there)
    native_bf16: bool
    sm: tuple[int, int] | None = None  # CUDA compute capability (major, minor)
    fbgemm: bool = False  # a CPU where torch runs fbgemm's dynamic int8 linear (quant_dynamic.py)
    vnni: bool = False  # a CPU with AVX512-VNNI: fbgemm's int8 dot products cannot saturate there

    @property
    def label(self) -> str:
        return f"{self.kind} sm{self.sm[0]}{self.sm[1]}" if self.sm else self.kind


def cpu(native_bf16: bool, *, fbgemm: bool = False, vnni: bool = False) -> Capability:
    return Capability("cpu", native_bf16, fbgemm=fbgemm, vnni=vnni)


def cuda(major: int, minor: int = 0) -> Capability:
    """A CUDA device of compute capability ``major.minor`` (bf16 is native from sm80 on)."""
    return Capability("cuda", major >= 8, (major, minor))


def mps(native_bf16: bool = True) -> Capability:
    return Capability("mps", native_bf16)


def probe(device: torch.device) -> Capability:
    """The capability of ``device`` itself (``cuda:1`` asks GPU 1, not GPU 0)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return cuda(major, minor)
    if device.type == "meta":
        return Capability("meta", True)  # every kernel dequant: plain torch ops, which meta runs
    if device.type == "mps":
        # bf16 on MPS needs macOS 14 (torch refuses bf16 tensors there otherwise)
        return mps(bool(torch.backends.mps.is_macos_or_newer(14, 0)))
    from swarm.model.dtypes import cpu_has_avx512_vnni, cpu_has_native_bf16
    from swarm.model.quant_dynamic import fbgemm_available

    return cpu(cpu_has_native_bf16(), fbgemm=fbgemm_available(), vnni=cpu_has_avx512_vnni())


def auto_dtype(cap: Capability, model_type: str | None = None) -> torch.dtype:
    """The serving dtype ``--dtype auto`` picks: bf16 where native; on a GPU without it fp16,
    unless the model overflows fp16 (then fp32); on a CPU without it fp32."""
    if cap.native_bf16:
        return torch.bfloat16
    if cap.kind == "cpu" or model_type in FP16_OVERFLOWS:
        return torch.float32
    return torch.float16


def dtype_problem(cap: Capability, dtype: torch.dtype, model_type: str | None = None) -> str | None:
    """Why ``dtype`` is wrong on ``cap`` for this model (None when it is fine): a reason to refuse
    an explicit ``--dtype`` before a NaN gets an honest peer evicted."""
    if dtype == torch.float16 and model_type in FP16_OVERFLOWS:
        return f"{model_type} overflows fp16 (activations past 65504); use bf16 or fp32"
    if dtype == torch.bfloat16 and cap.kind == "mps" and not cap.native_bf16:
        return "bf16 on MPS needs macOS 14 or later; use fp32"
    return None


def kv_format_problem(cap: Capability, kv_cache: str) -> str | None:
    """Why the KV cache format ``kv_cache`` (swarm.model.kvcache.KV_FORMATS) cannot be held on
    ``cap`` (None when it can). fp8 (float8_e4m3fn storage) is CUDA sm89+ (Ada, Hopper and later:
    the GPUs with fp8 hardware; older ones only emulate its casts) and the CPU, where torch's float8
    casts are plain software conversions that every torch this project supports implements: the
    cache is half the size there too (its speed is measured in benchmarks/bench_kv_quant.py). MPS
    has no float8 dtype. int8 and auto are plain torch ops on every device."""
    if kv_cache != "fp8" or cap.kind in ("cpu", "meta"):
        return None
    if cap.kind == "cuda" and cap.sm is not None and cap.sm >= (8, 9):
        return None
    return f"an fp8 KV cache needs a CUDA GPU of compute capability 8.9 or later or a CPU, not {cap.label}; use int8"


def int8_kernel(cap: Capability, dtype: torch.dtype) -> str:
    """How an int8 weight multiplies: ``int8pack`` (torch's packed kernel) or ``dequant``."""
    if cap.kind == "cpu":
        return "int8pack" if dtype == torch.bfloat16 else "dequant"  # fp32: a scalar path, 40-120x slower
    if cap.kind == "mps":
        return "int8pack" if dtype in (torch.bfloat16, torch.float16, torch.float32) else "dequant"
    return "dequant"  # CUDA: its int8pack kernel is naive; int8 x scales through cuBLAS is faster


def int4_kernel(cap: Capability, dtype: torch.dtype, n: int, k: int) -> str:
    """How an int4 (N, K) weight multiplies: ``int4pack_cpu``, ``int4pack_cuda`` (the tiled layout
    CUDA and MPS share) or ``dequant``."""
    if cap.kind == "cpu":
        return "int4pack_cpu" if dtype == torch.bfloat16 and n % 16 == 0 else "dequant"
    tiles = n % 8 == 0 and k % 64 == 0
    if cap.kind == "cuda":
        sm80 = cap.sm is not None and cap.sm >= (8, 0)
        return "int4pack_cuda" if sm80 and dtype == torch.bfloat16 and tiles else "dequant"
    if cap.kind == "mps":
        return "int4pack_cuda" if dtype in (torch.bfloat16, torch.float16) and tiles else "dequant"
    return "dequant"


def auto_quant(cap: Capability, dtype: torch.dtype, stored: str, shapes: list[tuple[int, int]]) -> str:
    """What ``--quant auto`` holds a checkpoint in: ``stored`` (the compact format of ours that keeps
    its decoder weights as stored: "int4", "int8" or "none", see swarm.model.packaged.stored_quant)
    where every (N, K) weight in ``shapes`` gets a packed kernel on ``cap`` at ``dtype``, else
    "none" (a dequantize-per-call layer is slower than the dense one it replaces)."""
    if stored == "int4" and shapes and all(int4_kernel(cap, dtype, n, k) != "dequant" for n, k in shapes):
        return "int4"
    if stored == "int8" and int8_kernel(cap, dtype) != "dequant":
        return "int8"
    return "none"


def head_kernel(cap: Capability, dtype: torch.dtype) -> str:
    """How an int8 LM head multiplies: ``fbgemm_dynamic`` (the activation quantized per call,
    quant_dynamic.py) on a CPU where torch runs fbgemm, at any serving dtype (it takes the
    activation in fp32, so fp32 serving gets it too); elsewhere as an int8 layer does
    (:func:`int8_kernel`)."""
    if cap.kind == "cpu" and cap.fbgemm:
        return "fbgemm_dynamic"
    return int8_kernel(cap, dtype)


def dynamic_reduce_range(cap: Capability) -> bool:
    """Whether ``fbgemm_dynamic`` must quantize activations to 7 bits: on a CPU without AVX512-VNNI
    fbgemm sums pairs of 8-bit products in int16, which 8-bit activations can saturate."""
    return not cap.vnni


def auto_head_quant(cap: Capability, dtype: torch.dtype, stored_head: str) -> str:
    """What ``--quant auto`` holds the LM head in: "int8" where the checkpoint stores it in 5 to 8
    bits (``stored_head``, gguf_quant.stored_head_quant) and this device has an int8 kernel for it
    at ``dtype`` (:func:`head_kernel`: not one that dequantizes per call), else "none" (dense).
    Measured on this project's 2-core AVX512-VNNI EPYC, 1 thread, one token, bf16
    (benchmarks/bench_head_matmul.py, load 4.2): 262144x640 (Gemma-3-270M) 41.5 ms dense, 28.0 ms
    int8pack, 12.1 ms fbgemm_dynamic; 49152x576 (SmolLM2-135M) 7.0, 4.8, 2.0 ms. Dense fp32 reads
    twice bf16's bytes, so fp32 serving gains more (not measured). An int4-stored head stays dense
    (not measured)."""
    return "int8" if stored_head == "int8" and head_kernel(cap, dtype) in ("int8pack", "fbgemm_dynamic") else "none"


def choose_head_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """:func:`head_kernel` on ``device`` itself (a GPU's kernel checked there, as :func:`choose_kernel` does)."""
    kernel = head_kernel(device_capability(device), dtype)
    if kernel == "int8pack" and device.type != "cpu" and not kernel_works(str(device), kernel, dtype):
        return "dequant"
    return kernel


def choose_head_quant(stored_head: str, device: torch.device, dtype: torch.dtype) -> str:
    """:func:`auto_head_quant` on ``device`` itself (its kernel checked there: :func:`choose_head_kernel`)."""
    quant = auto_head_quant(device_capability(device), dtype, stored_head)
    if quant != "none" and choose_head_kernel(device, dtype) == "dequant":
        return "none"
    return quant


def swarm_head_quant(quant: str, stored_head: str, device: torch.device, dtype: torch.dtype) -> str:
    """How a swarm's coordinator holds the LM head: as ``run --quant auto`` does on ``device``
    (:func:`choose_head_quant`) where the invite quantizes the layers (``quant`` not "none") and it
    serves narrower than fp32; dense in a dense swarm (as ``run --quant none``) and in fp32. Why not
    fp32: fbgemm's int8 head quantizes a chunk's rows with one activation scale, so a verified
    draft's logits would differ from the same rows decoded one at a time by about 1% of their range,
    and in fp32 the ring promises greedy tokens that do not depend on how the coordinator drafted
    (bf16 rows already differ in their last bits with the chunk's shape: there the promise is the
    replay of the same schedule). A receipt names it (``head_quant``), so ``run --receipt`` holds
    the head as the ring did."""
    if quant == "none" or dtype == torch.float32:
        return "none"
    return choose_head_quant(stored_head, device, dtype)


def choose_quant(stored: str, device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int]]) -> str:
    """:func:`auto_quant` on ``device`` itself (a GPU's kernels are checked there, as
    :func:`choose_kernel` does)."""
    quant = auto_quant(device_capability(device), dtype, stored, shapes)
    if quant != "none" and device.type != "cpu":
        kinds = {choose_kernel(quant, device, dtype, n, k) for n, k in shapes}
        return "none" if "dequant" in kinds else quant
    return quant


def table(cap: Capability, model_type: str | None = None) -> dict[str, object]:
    """Every rule's answer for ``cap`` at a typical shape (for status lines and gpu_check)."""
    dt = auto_dtype(cap, model_type)
    return {"device": cap.label, "auto_dtype": str(dt).removeprefix("torch."),
            "int8": int8_kernel(cap, dt), "int4": int4_kernel(cap, dt, 4096, 4096), "head_int8": head_kernel(cap, dt)}


@functools.cache
def kernel_works(device: str, kernel: str, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` gives the dequantized product on ``device`` (a 64x128 check, once per
    device, kernel and dtype; :func:`choose_kernel` does not ask it for the CPU, whose kernels the
    test suite checks)."""
    if kernel == "dequant":
        return True
    from swarm.model.quant_formats import Packed, int4_from_float, int8_from_float

    dev = torch.device(device)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    try:
        if kernel == "int8pack":
            q8, s8 = int8_from_float(w, dtype)
            want = x.float() @ (q8.float() * s8[:, None]).T
            spec, q, s = Packed.int8(w, dtype, dev, kernel=kernel)
        else:
            g = int4_from_float(w, 32, dtype)
            want = x.float() @ g.dequantize().T
            spec, q, s = Packed.int4(g, dtype, dev, kernel=kernel)
        got = spec.matmul(x.to(dev), q, s).float().cpu()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))


def choose_kernel(kind: str, device: torch.device, dtype: torch.dtype, n: int, k: int) -> str:
    """The kernel an int8/int4 (N, K) weight uses on ``device`` (the node's own: probed there)."""
    cap = device_capability(device)
    kernel = int8_kernel(cap, dtype) if kind == "int8" else int4_kernel(cap, dtype, n, k)
    if device.type != "cpu" and kernel != "dequant" and not kernel_works(str(device), kernel, dtype):
        return "dequant"
    return kernel


@functools.cache
def _capability(device: str) -> Capability:
    return probe(torch.device(device))


def device_capability(device: torch.device) -> Capability:
    """:func:`probe`, once per device (``cuda`` means ``cuda:0``: the index is kept explicit)."""
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
    return _capability(str(device))
