"""One memory budget per peer: what ``--memory`` (or ``auto``) offers is everything it will use.

Theory of operation
-------------------
A peer's peak is two parts. The *planned part* is the same arithmetic for every peer of a swarm
(the leader plans with it, every stage sizes its capacity with it, ``plan`` and ``status`` print
it): its block's weights, the KV cache of the sessions it reserves at the swarm's context (in the
swarm's KV format; its advert's own count, ``Peer.sessions``, else ``ModelSpec.sessions``), the
activations of one prefill chunk (``ModelSpec.activation_bytes``; a head-only coordinator runs no
stage and needs none), and where
it coordinates the embedding, final norm, head and its draft model. The *overhead* is this peer's
own and so is not in the swarm-wide ModelSpec: on a CPU (or MPS) the runtime itself (Python,
torch and the node's modules, :data:`RUNTIME_BYTES`) plus the largest layer's dense bytes (the
load-time peak: a block is converted one layer at a time); on CUDA nothing, because the runtime
lives in host RAM and the CUDA context is inside ``--memory auto``'s margin (devices.py).

A node subtracts its overhead from what it offers before it advertises (settings.advert_memory),
so an advert is the room for the planned part, and "fits" means ``predicted_peak <= advert``.
"""

from __future__ import annotations

from swarm.planner.spec import ModelSpec

# A running node's own VmHWM besides what it holds, on x86-64 Linux with torch 2.x (bundled model, fp32,
# benchmarks/bench_memory.py, an AMX CPU), since tensors are read rather than mapped (weights.py) and
# freed temporaries leave the process (node/compute/memory.py): a standby (imports, host, tokenizer
# not loaded, one dense layer measured) 371-374 MB; a stage less its block, its 8 full-context
# sessions' KV and a prefill chunk's activations ~386 MB; a head-only coordinator less its head
# 456 MB (its tokenizer, ~40 MB here, and the head's load, which reads the stored bf16 beside the
# fp32 copy, are in that). 440 MB put stages under 8 sessions at 0.91 of their predicted peak, but
# a clean-clone CI run of the whole suite saw an int4 stage loaded from the Q4_1 GGUF reach 700 MB
# of a 695 MB offer (1.03 of predicted): the spread between runs of one node is ~30 MB (heap
# arenas, which threads ran first), so the constant carries 40 MB for it. ~150 MB of the runtime
# are shared libraries' pages, of which a node touches more or fewer with other CPUs' kernels
# (AVX2, AVX512, AMX, NEON). Before the checkpoint's pages stopped counting it was 520 MB.
RUNTIME_BYTES = 480 * 10**6
PREFILL_CHUNK_TOKENS = 512  # the most tokens one forward takes (stage_worker.MAX_BATCH_TOKENS)


def predicted_peak(
    spec: ModelSpec,
    block: tuple[int, int],
    *,
    coordinator: bool,
    draft_bytes: int = 0,
    sessions: int | None = None,
) -> int:
    """The planned part of a peer's peak (bytes, in the spec's unit) holding layers ``block`` with
    the KV cache of ``sessions`` sessions (default: the spec's reserve), and the coordinator's
    part (with ``draft_bytes`` of draft model) where it coordinates."""
    start, end = block
    n = spec.sessions if sessions is None else sessions
    peak = sum(spec.weights[start:end]) + (end - start) * spec.session_kv_bytes_per_layer * n
    if end > start:
        peak += spec.activation_bytes
    if coordinator:
        peak += spec.coordinator_bytes + draft_bytes
    return peak


def sessions_that_fit(
    spec: ModelSpec, memory_bytes: int, block: tuple[int, int], *, coordinator: bool, draft_bytes: int = 0
) -> int | None:
    """How many sessions' KV fit beside the rest of ``predicted_peak`` in ``memory_bytes`` (may be
    0 or negative when even the weights do not fit); None when a session costs nothing here."""
    per_session = (block[1] - block[0]) * spec.session_kv_bytes_per_layer
    if per_session <= 0:
        return None
    base = predicted_peak(spec, block, coordinator=coordinator, draft_bytes=draft_bytes, sessions=0)
    return (memory_bytes - base) // per_session


def runtime_overhead(device_kind: str, largest_layer_dense_bytes: int) -> int:
    """This peer's overhead (real bytes) outside the planned part: see the module doc."""
    if device_kind == "cuda":
        return 0
    return RUNTIME_BYTES + largest_layer_dense_bytes
