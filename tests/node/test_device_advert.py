"""A node on a GPU advertises that GPU and the memory it can offer there, and the planner budgets
against it (CUDA faked: this machine has none; see tests/model/test_devices.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.errors import PlanningError
from swarm.manifest.identity import Identity
from swarm.model.devices import GIB, gpu_margin_bytes
from swarm.node.members.membership import Membership
from swarm.node.settings import NodeSettings, advertised_resources
from swarm.planner import ModelSpec, Peer, parse_peers_file
from swarm.planner import plan as make_plan
from swarm.proto.messages import parse_message
from swarm.testing.hardware import fake_hardware

SWARM = "0123456789abcdef0123456789abcdef"
IDS = [Identity(bytes([i + 1]) * 32) for i in range(2)]


def _settings(i: int, **kw: object) -> NodeSettings:
    return NodeSettings(seed=bytes([i + 1]) * 32, swarm_id=SWARM, secret=b"k" * 32, model_dir=Path("/unused"), **kw)  # type: ignore[arg-type]


def _advert(i: int, settings: NodeSettings) -> Membership:
    memory, device = advertised_resources(settings)
    return Membership(IDS[i], SWARM, addrs=[f"/ip4/127.0.0.1/tcp/{4000 + i}"], device=device, memory_bytes=memory,
                      ms_per_layer=0.2, first_seq=1)  # fmt: skip


def test_a_gpu_node_advertises_its_gpu_and_free_device_memory_less_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=2, free=20 * GIB, total=24 * GIB)
    m = _advert(0, _settings(0, device="cuda:1"))
    got = parse_message(m.local.to_frame())  # what the other peers read off the wire
    assert (got.device_kind, got.device_name) == ("cuda:1", "NVIDIA GeForce RTX 4090 #1, 24 GiB")  # type: ignore[attr-defined]
    assert got.memory_bytes == 20 * GIB - gpu_margin_bytes(24 * GIB)  # type: ignore[attr-defined]
    # --memory wins over the device's free memory
    explicit = _advert(0, _settings(0, device="cuda:1", memory_bytes=3 * GIB))
    assert explicit.local.memory_bytes == 3 * GIB and explicit.local.device_kind == "cuda:1"


def test_a_cpu_node_on_a_gpu_box_advertises_its_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hardware(monkeypatch, cuda=1)
    m = _advert(0, _settings(0, device="cpu"))
    assert m.local.device_kind == "cpu" and "RTX" not in m.local.device_name


def test_the_planner_budgets_against_the_advertised_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # a model of 40 layers x 0.5 GiB (KV included): 20 GiB, more than the 16 GiB GPU offers alone
    spec = ModelSpec(n_layers=40, layer_bytes=GIB // 2, coordinator_bytes=GIB // 4)
    fake_hardware(monkeypatch, cuda=1, free=16 * GIB + gpu_margin_bytes(24 * GIB), total=24 * GIB)
    gpu = _advert(0, _settings(0, device="cuda:0"))
    assert gpu.local.memory_bytes == 16 * GIB
    small = _advert(1, _settings(1, device="cpu", memory_bytes=6 * GIB))
    gpu.offer(small.local)
    pf = parse_peers_file(gpu.peers_file(), where="view")
    peers = [Peer(p.id, p.memory_bytes, p.ms_per_layer, True, p.addresses) for p in pf.peers]
    rtt = {IDS[0].peer_id: {IDS[1].peer_id: 1.0}, IDS[1].peer_id: {IDS[0].peer_id: 1.0}}
    placed = make_plan(spec, peers, rtt)
    blocks = placed.blocks
    held = {p: b - a for p, (a, b) in blocks.items()}
    assert sum(held.values()) == 40
    assert held[IDS[0].peer_id] * spec.bytes_per_layer <= 16 * GIB  # never more than the GPU offers
    with pytest.raises(PlanningError):  # the GPU's offer alone cannot hold the model
        make_plan(spec, peers[:1], {})


def test_timing_a_layer_waits_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """ms/layer on an accelerator must time the work, not the kernel launch: each timed pass
    synchronizes the device (here the CPU, with the synchronize call observed)."""
    from swarm.model.config import ModelArgs
    from swarm.node.compute import runtime
    from swarm.testing.checkpoints import TinySpec, tiny_config

    calls: list[torch.device] = []
    monkeypatch.setattr(runtime, "synchronize", lambda d: calls.append(d))
    args = ModelArgs.from_config(tiny_config(TinySpec(family="llama", n_layers=1)))
    ms = runtime.measure_ms_per_layer(args, torch.float32, "cpu", repeats=5)
    assert ms > 0 and len(calls) == 6 and all(d == torch.device("cpu") for d in calls)


@pytest.mark.parametrize(("device", "dtype"), [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda:0", torch.float16)])
def test_a_node_advertises_its_offer_less_its_overhead_and_peak_bytes_is_its_inverse(
    monkeypatch: pytest.MonkeyPatch, device: str, dtype: torch.dtype
) -> None:
    """--memory is the whole budget (planner/budget.py): a CPU node's advert leaves out the runtime
    (a coordinator's: any peer may be chosen) and one dense layer, a GPU node's nothing; the offer
    that peak_bytes names for a block and the head is advertised as room for exactly that predicted
    peak, and a stage's predicted peak is the coordinator's runtime less than the offer advertised
    as room for its block."""
    from swarm.model.config import ModelArgs
    from swarm.model.quant import layer_bytes
    from swarm.node.settings import advert_memory, model_spec, peak_bytes
    from swarm.planner.budget import COORDINATOR_RUNTIME_BYTES, RUNTIME_BYTES, predicted_peak
    from swarm.testing.checkpoints import TinySpec, tiny_config

    fake_hardware(monkeypatch, cuda=1)
    args = ModelArgs.from_config(tiny_config(TinySpec(n_layers=6)))
    width = torch.empty(0, dtype=dtype).element_size()
    cpu = not device.startswith("cuda")
    overhead = RUNTIME_BYTES + COORDINATOR_RUNTIME_BYTES + layer_bytes(args, "none", width) if cpu else 0
    assert advert_memory(GIB + overhead, dtype, device, args) == GIB * 2 // width  # the planner's 2-byte unit
    assert advert_memory(overhead // 2, dtype, device, args) == 0
    spec = model_spec(args, torch.bfloat16, 256, sessions=8)
    for block, coord in (((0, 3), True), ((3, 6), False)):
        offer = peak_bytes(args, dtype, device, spec, block, coordinator=coord)
        unused = 0 if coord or not cpu else COORDINATOR_RUNTIME_BYTES  # a stage's share of what the advert left out
        # at its own width: the coordinator's float32 logits do not widen (ModelSpec.head_session_bytes)
        assert advert_memory(offer + unused, dtype, device, args) == predicted_peak(spec.at_width(width), block,
                                                                                    coordinator=coord)  # fmt: skip


def test_the_speed_probe_runs_through_more_layers_than_the_cache_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's weights stream from memory; one small layer alone runs from the cache and measured
    half a block's time per layer (benchmarks/bench_probe_compiled.py). The probe takes enough
    synthetic layers for twice the last-level cache (at most 8; one where a layer is that big),
    and reports the time per layer."""
    from swarm.model.config import ModelArgs
    from swarm.model.quant import layer_bytes
    from swarm.node.compute import runtime
    from swarm.testing.checkpoints import TinySpec, tiny_config

    mb = 1 << 20
    assert runtime.probe_layers(14 * mb, 32 * mb) == 5 and runtime.probe_layers(7 * mb, 32 * mb) == 8
    assert runtime.probe_layers(2000 * mb, 32 * mb) == 1 and runtime.probe_layers(16 * mb, None) == 4
    args = ModelArgs.from_config(tiny_config(TinySpec(family="llama", n_layers=6)))
    built: list[int] = []

    class Counted(runtime.Stage):  # type: ignore[misc, name-defined]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            built.append(self.end - self.start)

    monkeypatch.setattr(runtime, "Stage", Counted)
    one = layer_bytes(args, "none", 4)
    monkeypatch.setattr(runtime, "last_level_cache_bytes", lambda: 3 * one // 2)  # three layers' worth of probe
    assert runtime.measure_ms_per_layer(args, torch.float32, "cpu", repeats=3) > 0 and built == [3]
    monkeypatch.setattr(runtime, "last_level_cache_bytes", lambda: 100 * one)  # capped by the model's own layers
    assert runtime.measure_ms_per_layer(args, torch.float32, "cpu", repeats=3) > 0 and built[-1] == 6
