"""A quantized stage's predicted weights equal what its loaded layers hold (issue 26).

The planner counts in a 2-byte unit and a peer serving fp32 advertises half its memory in it
(settings.plan_memory); a quantized layer's packed integers do not widen, so its peer's advert
says its width and the planner states the layer at it (ModelSpec.at_width, Peer.own). Here the
node's own arithmetic (settings.model_spec, then Peer.own and budget.predicted_peak, the planner's
functions) is held to the storage bytes of real stages loaded from the bundled checkpoint:
int4 and int8 from the bf16 safetensors and int4 from the bundled Q4_1 GGUF, served in fp32 and bf16.
Storage bytes, not RSS: every tensor a layer keeps (parameters and buffers)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from swarm.model.bundled import bundled_gguf_path, default_model_dir
from swarm.model.quant import block_nbytes, layer_compact_bytes_each, layer_load_bytes
from swarm.model.stage import Stage
from swarm.model.weights import open_checkpoint
from swarm.node.settings import advert_memory, model_spec, peak_bytes
from swarm.planner import Peer
from swarm.planner.budget import predicted_peak

LAYERS = (4, 7)  # a few layers of the bundled model's 30 are enough: all are alike


def _resident(stage: Stage) -> int:
    """Every byte the stage's layers keep: parameters and buffers (the compact weights included)."""
    return sum(block_nbytes(layer) for layer in stage.layers)


def _stated(path: Path, quant: str, dtype: torch.dtype) -> int:
    """The planner's weights of LAYERS for a peer serving ``dtype`` (at load: no KV, no activations),
    in real bytes: its advert's unit times its width over 2."""
    args = open_checkpoint(path).args
    spec = Peer("me", 0, 1.0, dtype_bytes=dtype.itemsize).own(model_spec(args, torch.bfloat16, 512, quant))
    return predicted_peak(spec, LAYERS, coordinator=False, at_load=True) * dtype.itemsize // 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("source", "quant"), [("safetensors", "int4"), ("safetensors", "int8"), ("gguf", "int4")])
def test_predicted_weights_are_what_a_quantized_stage_holds(source: str, quant: str, dtype: torch.dtype) -> None:
    path = default_model_dir() if source == "safetensors" else bundled_gguf_path()
    ck = open_checkpoint(path)
    stage = Stage.load(ck.args, ck.source, *LAYERS, dtype=dtype, quant=quant)
    held = _resident(stage)
    assert held == _stated(path, quant, dtype)
    # the integers are the part that keeps its size: the same at either width
    ints = sum(b.numel() * b.element_size() for layer in stage.layers for n, b in layer.named_buffers()
               if n.endswith("qweight"))  # fmt: skip
    assert ints == sum(layer_compact_bytes_each(ck.args, quant)[LAYERS[0]:LAYERS[1]])
    dense = Stage.load(ck.args, ck.source, *LAYERS, dtype=dtype) if source == "safetensors" else None
    if dense is not None:  # what the compact form saves, against the same layers dense
        assert held < (0.26 if quant == "int8" and dtype == torch.float32 else 0.51) * _resident(dense)


def test_an_fp32_peer_without_its_width_is_budgeted_at_twice_its_integers() -> None:
    """What adverts without ``dtype_bytes`` (older peers) get: the old, safe over-count."""
    path = default_model_dir()
    ck = open_checkpoint(path)
    held = _resident(Stage.load(ck.args, ck.source, *LAYERS, dtype=torch.float32, quant="int4"))
    spec = model_spec(ck.args, torch.bfloat16, 512, "int4")
    old = predicted_peak(Peer("me", 0, 1.0).own(spec), LAYERS, coordinator=False, at_load=True) * 4 // 2
    ints = sum(layer_compact_bytes_each(ck.args, "int4")[LAYERS[0]:LAYERS[1]])
    assert old == held + ints  # the integers counted twice over


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_a_peers_advert_is_room_for_the_peak_it_predicts(quant: str) -> None:
    """peak_bytes (status, local offers) and advert_memory stay each other's inverse at fp32 with the
    layers at their own width: an offer sized for a block advertises room for exactly that block."""
    args = open_checkpoint(default_model_dir()).args
    spec = model_spec(args, torch.bfloat16, 512, quant, sessions=8)
    own = Peer("me", 0, 1.0, dtype_bytes=4).own(spec)
    for block in ((0, 9), (9, 30)):
        offer = peak_bytes(args, torch.float32, "cpu", spec, block, coordinator=True)
        assert advert_memory(offer, torch.float32, "cpu", args) == predicted_peak(own, block, coordinator=True)


def _allocation_peak(fn: Callable[[], Stage]) -> tuple[Stage, int]:
    """(fn(), the most bytes torch's CPU allocator held at once while it ran, from the profiler's
    allocation records: exact sizes, not the process's RSS)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    records = sorted((r.start_ns(), r.nbytes()) for r in prof.profiler.kineto_results.events() if r.name() == "[memory]")
    assert records, "the profiler recorded no allocation"
    now = peak = 0
    for _, nbytes in records:
        now += nbytes
        peak = max(peak, now)
    return out, peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("source", "quant"), [("safetensors", "none"), ("safetensors", "int4"),
                                               ("safetensors", "int8"), ("gguf", "int4")])  # fmt: skip
def test_loading_a_layer_holds_at_most_its_predicted_load_peak(source: str, quant: str, dtype: torch.dtype) -> None:
    """A block's load never holds more than its resident bytes and one layer's load-time peak
    (quant.layer_load_bytes: the layer in the serving dtype, and the temporaries of quantizing its
    largest weight) at once: two layers loaded, the second's float weights beside the first's
    compact ones."""
    ck = open_checkpoint(default_model_dir() if source == "safetensors" else bundled_gguf_path())
    Stage.load(ck.args, ck.source, 0, 1, dtype=dtype, quant=quant)  # first-use caches (layouts) out of the figure
    stage, peak = _allocation_peak(lambda: Stage.load(ck.args, ck.source, 0, 2, dtype=dtype, quant=quant))
    beyond = peak - _resident(stage)
    bound = layer_load_bytes(ck.args, quant, dtype.itemsize)
    assert beyond <= bound
    if source == "safetensors" and quant != "none":  # from float weights the bound is a near one
        assert beyond > 0.5 * bound  # (a GGUF's int4 groups are repacked without a float copy)
