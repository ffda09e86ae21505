"""Every tensor of a loaded stage lives on the stage's device, for every weight format and
quantization (issue 29: a GGUF Q4 stage with ``--quant int4`` on a GPU kept its int4 weights on
the CPU, where numpy made them, and its first forward failed).

No GPU here, so the stage goes to torch's ``meta`` device, which is "another device than the CPU"
as far as placement goes: any tensor built on the CPU and never moved shows up as ``cpu``. On meta
the capability table picks the ``dequant`` kernel (plain torch ops), so a forward also runs there
and proves the layers' shapes and devices fit together (but for compact experts, whose routing
reads data).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from swarm.model.bundled import bundled_gguf_path
from swarm.model.stage import Stage
from swarm.model.weights import open_checkpoint
from swarm.testing.hf_checkpoints import write_family_checkpoint, write_mxfp4_gpt_oss
from tests.model.test_quant_gguf import _write as write_gguf

QUANTS = ("none", "int8", "int4", "mxfp4")


def _checkpoint(fmt: str, tmp: Path) -> Path:
    if fmt == "gguf_q4_1_bundled":
        return bundled_gguf_path()
    if fmt == "gguf_q4_k":
        return write_gguf(tmp / "m.gguf", Q.Q4_K)
    if fmt == "gguf_q8_0":
        return write_gguf(tmp / "m.gguf", Q.Q8_0)
    if fmt == "mxfp4_gpt_oss":
        return write_mxfp4_gpt_oss(tmp / "oss")
    return write_family_checkpoint(tmp / fmt, fmt)  # safetensors of a transformers family


def _misplaced(stage: Stage, device: torch.device) -> list[str]:
    named = [*stage.named_parameters(), *stage.named_buffers()]
    assert named, "a loaded stage holds tensors"
    return [f"{n} on {t.device}" for n, t in named if t.device != device]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("fmt", ["gguf_q4_1_bundled", "gguf_q4_k", "gguf_q8_0", "llama", "qwen3_moe", "mxfp4_gpt_oss"])
def test_every_tensor_of_a_loaded_stage_is_on_its_device(tmp_path: Path, fmt: str, quant: str) -> None:
    if fmt == "gguf_q8_0" and quant == "int4":
        pytest.skip("Q8_0 blocks are not int4 groups: int4 of a Q8_0 file re-rounds floats (covered by llama)")
    ck = open_checkpoint(_checkpoint(fmt, tmp_path))
    meta = torch.device("meta")
    stage = Stage.load(ck.args, ck.source, 0, min(2, ck.args.n_layers), dtype=torch.bfloat16, device=meta, quant=quant)
    assert _misplaced(stage, meta) == []
    if fmt in ("qwen3_moe", "mxfp4_gpt_oss") and quant != "none":
        return  # routing to experts reads which experts were hit: data, which meta does not have
    stage.open_session("s", 8)
    out = stage.forward("s", torch.empty(3, ck.args.dim, dtype=torch.bfloat16, device=meta))
    assert out.device == meta and out.shape == (3, ck.args.dim)


def test_out_of_memory_while_loading_is_a_clear_error_that_frees_the_block() -> None:
    """A block that does not fit: ModelError naming the device and the range (not a raw torch
    OutOfMemoryError from deep in a loader), and no layer of it kept."""
    import gc
    import weakref

    from benchmarks.gpu_shapes import RandomSource, small
    from swarm.errors import ModelError

    args = small("llama-3.3-70b")
    src = RandomSource(args, seed=0, fail_after=2)
    loaded: list[weakref.ref[torch.Tensor]] = []
    real_load = src.load

    def load(name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
        t = real_load(name, dtype, device)
        loaded.append(weakref.ref(t))
        return t

    src.load = load  # type: ignore[method-assign]
    with pytest.raises(ModelError, match=r"out of memory on cpu loading layers \[0, 4\) of llama in float32"):
        Stage.load(args, src, 0, 4, dtype=torch.float32)
    gc.collect()
    assert loaded and all(r() is None for r in loaded)  # layers 0 and 1 were loaded, then let go
    Stage.load(args, RandomSource(args), 0, 2, dtype=torch.float32)  # a smaller block still loads
