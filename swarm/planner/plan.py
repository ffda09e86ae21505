"""The planner's output: a :class:`Plan` every peer of the swarm computes identically."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import PlanningError


@dataclass(frozen=True)
class Plan:
    """Who holds which layers, in which ring order, and how fast it should run.

    ``ring`` lists the stage peers in traversal order: the coordinator sends the embedded token to
    ``ring[0]``, ..., ``ring[-1]`` sends the final hidden state back to the coordinator. Blocks are
    contiguous in ring order: ``blocks[ring[0]] == (0, k)``. The coordinator may itself be a stage
    (then it is ``ring[0]`` in a fresh plan). ``standbys`` are peers of the swarm outside the plan.
    """

    epoch: int
    n_layers: int
    coordinator: str
    ring: tuple[str, ...]
    blocks: dict[str, tuple[int, int]]
    standbys: tuple[str, ...]
    predicted_latency_ms: float  # sum of one-way hops around the traversal
    predicted_compute_ms: float  # sum of layers x ms_per_layer over the stages
    layers_moved: int = 0
    note: str | None = None
    hops_ms: tuple[float, ...] = field(default=())
    draft: bool = False  # the coordinator runs its draft model, whose bytes this plan budgets

    @property
    def predicted_traversal_ms(self) -> float:
        return self.predicted_latency_ms + self.predicted_compute_ms

    def predicted_tokens_per_s(self, g: float = 1.0) -> float:
        """Tokens per second with ``g`` accepted tokens per traversal (g = 1: no speculation)."""
        t = self.predicted_traversal_ms
        return math.inf if t <= 0 else 1000.0 * g / t

    def holder(self, layer: int) -> str:
        for peer, (s, e) in self.blocks.items():
            if s <= layer < e:
                return peer
        raise KeyError(layer)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (lists, not tuples); ``from_json`` reads it back exactly."""
        return {
            "epoch": self.epoch,
            "n_layers": self.n_layers,
            "coordinator": self.coordinator,
            "ring": list(self.ring),
            "blocks": {p: [s, e] for p, (s, e) in self.blocks.items()},
            "standbys": list(self.standbys),
            "predicted_traversal_ms": self.predicted_traversal_ms,
            "predicted_latency_ms": self.predicted_latency_ms,
            "predicted_compute_ms": self.predicted_compute_ms,
            "predicted_tokens_per_s": self.predicted_tokens_per_s(1.0),
            "hops_ms": list(self.hops_ms),
            "layers_moved": self.layers_moved,
            "note": self.note,
            "draft": self.draft,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> Plan:
        """Parse a plan dict (or its JSON text); PlanningError naming the bad field."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise PlanningError(f"plan JSON: not valid JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(data, Mapping):
            raise PlanningError("plan JSON: expected an object")
        try:
            blocks_raw = data["blocks"]
            blocks = {str(p): (int(v[0]), int(v[1])) for p, v in blocks_raw.items()}
            ring = tuple(str(p) for p in data["ring"])
            if set(blocks) != set(ring) or len(ring) != len(set(ring)):
                raise PlanningError("plan JSON: blocks and ring name different peers")
            plan = cls(
                epoch=int(data["epoch"]),
                n_layers=int(data["n_layers"]),
                coordinator=str(data["coordinator"]),
                ring=ring,
                blocks={p: blocks[p] for p in ring},
                standbys=tuple(str(p) for p in data.get("standbys", ())),
                predicted_latency_ms=float(data["predicted_latency_ms"]),
                predicted_compute_ms=float(data["predicted_compute_ms"]),
                layers_moved=int(data.get("layers_moved", 0)),
                note=data.get("note"),
                hops_ms=tuple(float(h) for h in data.get("hops_ms", ())),
                draft=bool(data.get("draft", False)),
            )
        except KeyError as exc:
            raise PlanningError(f"plan JSON: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, IndexError, AttributeError) as exc:
            raise PlanningError(f"plan JSON: malformed field ({exc})") from None
        check_blocks(plan)
        return plan


def check_blocks(plan: Plan) -> None:
    """Blocks are non-empty, contiguous in ring order and cover [0, n_layers) exactly."""
    at = 0
    for p in plan.ring:
        s, e = plan.blocks[p]
        if s != at or e <= s:
            raise PlanningError(f"plan: block of {p} is [{s}, {e}), expected to start at {at}")
        at = e
    if at != plan.n_layers:
        raise PlanningError(
            f"plan: blocks cover [0, {at}) but the model has {plan.n_layers} layers"
        )
