"""The planner's inputs: what the model needs, what each peer offers, and hop latencies.

Everything is plain numbers (bytes, milliseconds) so the planner never touches a file, a socket
or torch. Peer order is never taken from a dict: callers may pass peers in any order and every
peer of a swarm still computes the same plan, because the planner sorts by peer ID first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from swarm.errors import UsageError

GB = 10**9  # decimal gigabytes, as in "memory_gb" of a peers file


@dataclass(frozen=True)
class ModelSpec:
    """What placing one model costs.

    ``coordinator_bytes`` is what the coordinator holds besides any layers: embedding, final norm,
    LM head and the draft model. ``context_tokens`` is the KV-cache length of a session, and every
    stage reserves ``sessions`` of them per layer. ``activation_bytes`` is what one prefill chunk's
    forward through a layer holds at once (a stage's transient peak; budget.py), and
    ``inflight_bytes`` what one session's hidden states on their way can hold at a stage (a prompt
    sent round the ring a window of pieces at a time: model/speculative.DEFAULT_PREFILL_WINDOW).
    ``head_logit_values`` is what one session's logits at the coordinator count (rows x vocabulary:
    model/speculative.head_logit_values): with its prefill window's results waiting for the head
    (``inflight_bytes`` again) they are what a session in flight holds there (:meth:`head_session_bytes`).
    ``layer_bytes_each`` gives each layer's own weights where layers differ (DeepSeek-V3 and
    GLM-4.5 have dense first layers and MoE layers after them); empty means every layer weighs
    ``layer_bytes``, which is always the largest layer's weights.

    Every byte is counted in the planner's unit: a value 2 bytes wide (settings.plan_memory). A
    quantized layer's packed integers do not widen with the serving dtype, though: an int4 layer
    served in fp32 holds its nibbles as they are, and only its scales and norms at 4 bytes.
    ``compact_bytes_each`` gives, per layer, the part of its weights that keeps its size at every
    width (empty: none, a dense model), so :meth:`at_width` can state a layer in the planner's unit
    for a peer whatever width it serves; ``width`` is the width a spec states its peer's values at
    (2 unless made by :meth:`at_width`).
    """

    n_layers: int
    layer_bytes: int
    kv_bytes_per_token_per_layer: int = 0
    coordinator_bytes: int = 0
    context_tokens: int = 0
    layer_bytes_each: tuple[int, ...] = ()
    sessions: int = 1
    activation_bytes: int = 0
    compact_bytes_each: tuple[int, ...] = ()
    inflight_bytes: int = 0
    head_logit_values: int = 0
    width: int = 2
    # real bytes of an int8 copy of the LM head a coordinator holds beside the dense one where it
    # serves narrower than fp32 (capability.swarm_head_quant; ModelArgs.head_int8_bytes): memory,
    # not disk, and not widened with the values (its integers keep their size)
    head_int8_bytes: int = 0

    def __post_init__(self) -> None:
        if self.n_layers < 1:
            raise UsageError(f"model: n_layers must be at least 1, got {self.n_layers}")
        for name in (
            "layer_bytes",
            "kv_bytes_per_token_per_layer",
            "coordinator_bytes",
            "context_tokens",
            "activation_bytes",
            "inflight_bytes",
            "head_logit_values",
            "head_int8_bytes",
        ):
            if getattr(self, name) < 0:
                raise UsageError(f"model: {name} must not be negative, got {getattr(self, name)}")
        if self.sessions < 1:
            raise UsageError(f"model: sessions must be at least 1, got {self.sessions}")
        if self.layer_bytes + self.kv_bytes_per_token_per_layer * self.context_tokens <= 0:
            raise UsageError("model: a layer must cost some memory (layer_bytes or KV bytes > 0)")
        each = self.layer_bytes_each
        if each and (len(each) != self.n_layers or min(each) < 0 or max(each) != self.layer_bytes):
            raise UsageError(
                f"model: layer_bytes_each must give {self.n_layers} sizes >= 0 whose largest is "
                f"layer_bytes ({self.layer_bytes}); got {len(each)} sizes"
            )
        fixed = self.compact_bytes_each
        if fixed and (len(fixed) != self.n_layers or any(not 0 <= f <= w for f, w in zip(fixed, self.weights, strict=True))):
            raise UsageError(
                f"model: compact_bytes_each must give {self.n_layers} sizes, each >= 0 and at most its "
                f"layer's weights; got {len(fixed)} sizes"
            )

    def at_width(self, dtype_bytes: int) -> ModelSpec:
        """This spec for a peer serving values ``dtype_bytes`` wide, still in the planner's unit
        (real bytes × 2 / ``dtype_bytes``, as that peer advertises its memory): a layer's compact
        part ``c`` is ``c`` real bytes at any width, so ``c × 2 / dtype_bytes`` here (rounded up:
        a prediction never falls below what the peer holds), the rest of its weights as they were.
        KV, activations and the head widen with the values and stay as they are (the coordinator's
        float32 logits do not: :meth:`head_session_bytes` reads ``width``). The spec itself at 2
        bytes."""
        if dtype_bytes < 1:
            raise UsageError(f"model: dtype_bytes must be at least 1, got {dtype_bytes}")
        if dtype_bytes == 2:
            return self
        if not any(self.compact_bytes_each):
            return dataclasses.replace(self, width=dtype_bytes)
        each = tuple(w - c + -(-c * 2 // dtype_bytes) for w, c in zip(self.weights, self.compact_bytes_each, strict=True))
        fixed = tuple(-(-c * 2 // dtype_bytes) for c in self.compact_bytes_each)
        return dataclasses.replace(self, layer_bytes=max(each), layer_bytes_each=each, compact_bytes_each=fixed,
                                   width=dtype_bytes)  # fmt: skip

    @property
    def session_kv_bytes_per_layer(self) -> int:
        """One session's KV cache in one layer, at the context length."""
        return self.kv_bytes_per_token_per_layer * self.context_tokens

    @property
    def kv_bytes_per_layer(self) -> int:
        """The KV cache a layer reserves: ``sessions`` sessions at the context length."""
        return self.session_kv_bytes_per_layer * self.sessions

    @property
    def bytes_per_layer(self) -> int:
        """Weights plus the reserved KV cache of the largest layer."""
        return self.layer_bytes + self.kv_bytes_per_layer

    @property
    def smallest_bytes_per_layer(self) -> int:
        return min(self.weights) + self.kv_bytes_per_layer

    def transient_at(self, sessions: int) -> int:
        """What a stage holds besides weights and KV: one forward's activations, and the hidden
        states ``sessions`` sessions may have on their way (each a prefill window's)."""
        return self.activation_bytes + sessions * self.inflight_bytes

    def head_session_bytes(self) -> int:
        """What one session in flight holds at the coordinator, in the planner's unit: its prefill
        window's results waiting for the head (``inflight_bytes``: a head-only coordinator receives
        every piece's hidden states) and one chunk's logits, float32 at any width, beside the head's
        output in the model dtype until it is upcast (Head.logits; in float32 there is no copy)."""
        w = self.width
        real = self.head_logit_values * (4 + (w if w < 4 else 0))
        return self.inflight_bytes + -(-real * 2 // w)

    def coordinator_at(self, sessions: int) -> int:
        """What the coordinator holds besides layers and a draft model with ``sessions`` sessions
        in flight: embedding, final norm and head (and the head's int8 copy where this width holds
        one: ``head_int8_bytes``), and each session's :meth:`head_session_bytes`."""
        int8_head = -(-self.head_int8_bytes * 2 // self.width) if self.width < 4 else 0
        return self.coordinator_bytes + int8_head + sessions * self.head_session_bytes()

    @property
    def transient_bytes(self) -> int:
        """:meth:`transient_at` its own ``sessions``."""
        return self.transient_at(self.sessions)

    @property
    def weights(self) -> tuple[int, ...]:
        """Each layer's weights (bytes)."""
        return self.layer_bytes_each or (self.layer_bytes,) * self.n_layers

    @property
    def uniform(self) -> bool:
        """Whether every layer costs the same."""
        return min(self.weights) == self.layer_bytes

    def block_bytes(self, start: int, end: int) -> int:
        """Weights plus reserved KV cache of layers [start, end) (budget.predicted_peak adds the
        activations and the coordinator's part)."""
        return sum(self.weights[start:end]) + (end - start) * self.kv_bytes_per_layer

    @property
    def total_bytes(self) -> int:
        return self.block_bytes(0, self.n_layers) + self.coordinator_bytes


@dataclass(frozen=True)
class Peer:
    """One machine as it advertises itself: memory it offers and its measured speed."""

    id: str
    memory_bytes: int
    ms_per_layer: float
    coordinator_ok: bool = True
    addresses: tuple[str, ...] = field(default=())
    # a draft model this peer would run as coordinator: ms per drafted token (None: it holds
    # none) and the bytes it takes there (weights and a context's KV cache)
    draft_ms: float | None = None
    draft_bytes: int = 0
    # what it already holds on disk (so placing these there moves no bytes) and its disk budget
    # for layers and the head it does not hold yet (None: unbounded); issue 25
    held: frozenset[int] = frozenset()
    held_head: bool = False
    disk_bytes: int | None = None
    # the sessions whose KV its stage reserves (its own ``join --sessions``); None: the spec's
    # (the planning peer's) count, as before adverts carried it (issue 26)
    sessions: int | None = None
    # the width of the values it serves in, bytes (4: fp32); None: the planner's unit, 2 (an advert
    # without it, which counts a quantized layer on an fp32 peer at twice its compact bytes: safe)
    dtype_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise UsageError("peer: empty peer ID")
        if self.memory_bytes < 0:
            raise UsageError(f"peer {self.id}: memory must not be negative")
        if not (math.isfinite(self.ms_per_layer) and self.ms_per_layer >= 0):
            raise UsageError(f"peer {self.id}: ms_per_layer must be a finite number >= 0")
        if self.draft_ms is not None and not (math.isfinite(self.draft_ms) and self.draft_ms >= 0):
            raise UsageError(f"peer {self.id}: draft_ms must be a finite number >= 0")
        if self.draft_bytes < 0:
            raise UsageError(f"peer {self.id}: draft bytes must not be negative")
        if self.disk_bytes is not None and self.disk_bytes < 0:
            raise UsageError(f"peer {self.id}: disk bytes must not be negative")
        if self.sessions is not None and self.sessions < 1:
            raise UsageError(f"peer {self.id}: sessions must be at least 1, got {self.sessions}")
        if self.dtype_bytes is not None and self.dtype_bytes not in (1, 2, 4, 8):
            raise UsageError(f"peer {self.id}: dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes}")

    def own(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` with this peer's own session count and at its own width (ModelSpec.at_width):
        the spec its memory is planned and its stage's capacity sized with (the spec itself where
        it gives neither)."""
        if self.dtype_bytes is not None:
            spec = spec.at_width(self.dtype_bytes)
        if self.sessions is None or self.sessions == spec.sessions:
            return spec
        return dataclasses.replace(spec, sessions=self.sessions)

    def coordinator_part(self, spec: ModelSpec) -> int:
        """Bytes it holds as coordinator besides layers: embedding, head, what its own sessions
        hold there in flight (ModelSpec.coordinator_at) and its draft model."""
        own = self.own(spec)
        return own.coordinator_at(own.sessions) + self.draft_bytes

    def layer_capacity(self, spec: ModelSpec, *, coordinator: bool = False, smallest: bool = False) -> int:
        """How many layers fit (with the KV cache of its own sessions and a stage's transient bytes),
        each counted at the largest layer's bytes (``smallest``: the smallest layer's); -1 if it
        cannot even hold the coordinator part (with its draft model, if it holds one). The same
        sum as budget.predicted_peak."""
        free = self.memory_bytes - (self.coordinator_part(spec) if coordinator else 0)
        if free < 0:
            return -1
        own = self.own(spec)
        per_layer = own.smallest_bytes_per_layer if smallest else own.bytes_per_layer
        fit = max(0, min(spec.n_layers, (free - own.transient_bytes) // per_layer))
        return min(fit, self.disk_capacity(spec, coordinator=coordinator))

    def moved_bytes(self, spec: ModelSpec, start: int, end: int, *, coordinator: bool = False) -> int:
        """Bytes it must fetch to hold layers [start, end) (and the head, as coordinator): the
        weights of the layers it does not hold yet."""
        w = spec.weights
        new = sum(w[i] for i in range(start, end) if i not in self.held)
        return new + (spec.coordinator_bytes if coordinator and not self.held_head else 0)

    def stores(self, spec: ModelSpec, start: int, end: int, *, coordinator: bool = False) -> bool:
        """Whether its disk budget takes what it must fetch for that block."""
        return self.disk_bytes is None or self.moved_bytes(spec, start, end, coordinator=coordinator) <= self.disk_bytes

    def disk_capacity(self, spec: ModelSpec, *, coordinator: bool = False) -> int:
        """The most layers any block of its may have by its disk budget (the layers it holds plus
        the smallest ones it could fetch; exact for a peer holding none of equal-size layers,
        an upper bound otherwise: ``stores`` is the exact test); -1 if the head does not fit."""
        if self.disk_bytes is None:
            return spec.n_layers
        room = self.disk_bytes - (spec.coordinator_bytes if coordinator and not self.held_head else 0)
        if room < 0:
            return -1
        held = sum(1 for i in self.held if 0 <= i < spec.n_layers)
        for w in sorted(spec.weights[i] for i in range(spec.n_layers) if i not in self.held):
            if w > room:
                break
            room -= w
            held += 1
        return held


class Latency:
    """One-way hop latencies between peers, from an RTT matrix and optional one-way measurements.

    ``hop(a, b)`` uses, in order: a measured one-way ``one_way_ms[a][b]``; ``rtt_ms[a][b] / 2``
    (the round trip measured by ``a``); ``rtt_ms[b][a] / 2`` (a round trip is the same path seen
    from the other end). With none of these the pair is unreachable (``inf``). A peer's hop to
    itself is 0.
    """

    def __init__(
        self,
        rtt_ms: Mapping[str, Mapping[str, float]],
        one_way_ms: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        self._rtt = {a: dict(row) for a, row in rtt_ms.items()}
        self._one = {a: dict(row) for a, row in (one_way_ms or {}).items()}
        for table, name in ((self._rtt, "rtt_ms"), (self._one, "one_way_ms")):
            for a, row in table.items():
                _check_row(row, name, a)
        self._cache: dict[tuple[str, str], float] = {}

    def hop(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        key = (a, b)
        v = self._cache.get(key)
        if v is None:
            v = self._lookup(a, b)
            self._cache[key] = v
        return v

    def _lookup(self, a: str, b: str) -> float:
        one = self._one.get(a)
        if one is not None and b in one:
            return float(one[b])
        row = self._rtt.get(a)
        if row is not None and b in row:
            return float(row[b]) / 2.0
        back = self._rtt.get(b)
        if back is not None and a in back:
            return float(back[a]) / 2.0
        return math.inf

    def reachable(self, a: str, b: str) -> bool:
        return math.isfinite(self.hop(a, b))

    def nearest(self, a: str, among: Iterable[str], k: int) -> list[str]:
        """The k peers of ``among`` with the shortest round trip a -> b -> a (ties by ID)."""
        scored = []
        for b in among:
            if b == a:
                continue
            rt = self.hop(a, b) + self.hop(b, a)
            if math.isfinite(rt):
                scored.append((rt, b))
        scored.sort()
        return [b for _, b in scored[:k]]

    def smallest_out(self, a: str, k: int) -> list[float]:
        """The ``k`` smallest one-way estimates out of ``a`` that are cheap to list (screening)."""
        vals = [v / 2.0 for v in sorted(self._rtt.get(a, {}).values())[:k]]
        vals += sorted(self._one.get(a, {}).values())[:k]
        return sorted(vals)[:k]


def _check_row(row: Mapping[str, float], name: str, a: str) -> None:
    """Every value a finite number >= 0 (fast path in C; the slow scan only to name the culprit)."""
    vals = row.values()
    try:
        ok = not vals or (min(vals) >= 0 and math.isfinite(sum(vals)))
    except TypeError:
        ok = False
    if ok:
        return
    for b, v in row.items():
        if isinstance(v, bool) or not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
            raise UsageError(f"{name}[{a}][{b}] must be a finite number >= 0, got {v!r}")
    raise UsageError(f"{name}[{a}]: values must be finite numbers >= 0")
