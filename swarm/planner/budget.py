"""One memory budget per peer: what ``--memory`` (or ``auto``) offers is everything it will use.

Theory of operation
-------------------
A peer's peak is two parts. The *planned part* is the same arithmetic for every peer of a swarm
(the leader plans with it, every stage sizes its capacity with it, ``plan`` and ``status`` print
it): its block's weights, the KV cache of the sessions it reserves at the swarm's context (in the
swarm's KV format; its advert's own count, ``Peer.sessions``, else ``ModelSpec.sessions``), the
activations of one prefill chunk (``ModelSpec.activation_bytes``) and, per session, the hidden
states on their way that may wait in its queue (``ModelSpec.inflight_bytes``: a prompt, or a
resume's replay, goes round the ring a window of pieces at a time, node/ring/coordinator.py, so
a stage holds at most a window's of each session; a head-only coordinator runs no stage and
needs neither), and where it coordinates the embedding, final norm, head and its draft model,
and per session what waits for or comes out of the head (``ModelSpec.head_session_bytes``: the
results of its window, which the tail sends the coordinator whether or not it holds layers, and
one chunk's float32 logits; a 262k-token vocabulary makes those 1 MB a row). The *overhead* is this peer's
own and so is not in the swarm-wide ModelSpec: on a CPU (or MPS) the runtime itself (Python,
torch and the node's modules, :data:`RUNTIME_BYTES`), where it coordinates the coordinator's own
(:data:`COORDINATOR_RUNTIME_BYTES`: its tokenizer and the head's load), plus the load-time peak
of one layer (a block is loaded and converted one layer at a time: the largest layer's dense
bytes, and in an int8/int4 swarm the temporaries of quantizing its largest weight,
model/quant.layer_load_bytes); on CUDA nothing,
because the runtime lives in host RAM and the CUDA context is inside ``--memory auto``'s margin
(devices.py).

Every peer of a swarm plans in one unit, a value 2 bytes wide (settings.plan_memory: an fp32 peer
advertises half its memory), and states a quantized layer at its own width (its advert's
``dtype_bytes``; ``Peer.own`` and ``ModelSpec.at_width``): packed integers keep their size at any
width, so an fp32 peer's int4 layer is not its bf16 bytes doubled. The planner, a stage's and the
ring's capacity (node/ring/capacity.py), ``plan`` and ``status`` all go through ``Peer.own`` (or
``at_width`` with the peer's own width) and then :func:`predicted_peak`.

A node subtracts its overhead from what it offers before it advertises (settings.advert_memory),
so an advert is the room for the planned part, and "fits" means ``predicted_peak <= advert``. A
node advertises before any plan says whether it coordinates, and any peer may be chosen, so the
advert leaves out the coordinator's overhead on every peer; a peer planned as a stage then
predicts its peak without it, and that much of its offer stays unused (the advert carries no
per-peer coordinator overhead the planner could charge to the one it picks: a follow-up).

At load (``at_load``) a peer holds its block's weights, the coordinator part and its overhead,
no session's KV and no prefill chunk's activations yet: the peak to compare with a node's
VmHWM once it serves and before any session has run (status's ``predicted_load_peak_bytes``).
"""

from __future__ import annotations

from swarm.planner.spec import ModelSpec

# A running node's own VmHWM besides what it holds, on x86-64 Linux with torch 2.x, since tensors are
# read rather than mapped (weights.py) and freed temporaries leave the process (node/compute/memory.py);
# the bundled model in fp32 and int4 (benchmarks/bench_memory.py, memory.json) and a 2 GB fp32
# checkpoint fetched by join (benchmarks/bench_join_split.py --memlimit, memory_2gb.json). Per role,
# the VmHWM under 8 full-context sessions less the planned part and the dense layer:
# - a stage: 358-372 MB on the bundled model (fp32 [0, 15), [15, 30); int4 [9, 30) from bf16 345, from
#   the Q4_1 GGUF 334), ~330 MB on the 2 GB checkpoint. RUNTIME_BYTES is 410 MB: the worst seen plus
#   ~40 MB for the spread between runs of one node (heap arenas, which threads ran first), and ~150
#   MB of it are shared libraries' pages, of which other CPUs' kernels (AVX2, AVX512, AMX, NEON)
#   touch more or fewer;
# - a coordinator, 406-442 MB (head-only fp32 442; with a block 406-421), and once, in a clean-clone
#   CI run of the whole suite, an int4 node from the Q4_1 GGUF at 700 MB of a 695 MB offer (~450):
#   it holds the tokenizer (~40 MB here) and its head's load reads the stored tensors beside the
#   converted copy. COORDINATOR_RUNTIME_BYTES puts a coordinator at 480 MB in all, as the single
#   constant did before: what every advert leaves out (the module doc) does not change.
# A larger tokenizer adds what it holds beyond TOKENIZER_IN_RUNTIME (tokenizer.resident_bytes, from
# its counts of tokens and merges; ModelArgs.tokenizer_bytes): Gemma 3 270M's holds 290 MB (262k
# tokens, 515k merges), and without the term a head-only coordinator at its offer was OOM-killed and,
# with 400 MB more, held 1.13-1.19x its predicted peak (benchmarks/bench_head_memory.py,
# head_memory_gemma.json). A GGUF head's load reads its stored bytes a chunk at a time
# (gguf.GGUFFile.dequantized): Gemma's 671 MB fp32 head ~100 MB over, where reading them whole
# peaked 270 MB over.
# A standby (imports, host, one dense layer measured, no block) is 371-376 MB.
RUNTIME_BYTES = 410 * 10**6
COORDINATOR_RUNTIME_BYTES = 70 * 10**6
TOKENIZER_IN_RUNTIME = 40 * 10**6  # the tokenizer COORDINATOR_RUNTIME_BYTES holds; a larger one adds the rest
PREFILL_CHUNK_TOKENS = 512  # the most tokens one forward takes (stage_worker.MAX_BATCH_TOKENS)


def predicted_peak(
    spec: ModelSpec,
    block: tuple[int, int],
    *,
    coordinator: bool,
    draft_bytes: int = 0,
    sessions: int | None = None,
    at_load: bool = False,
) -> int:
    """The planned part of a peer's peak (bytes, in the spec's unit) holding layers ``block`` with
    the KV cache of ``sessions`` sessions (default: the spec's reserve), and the coordinator's
    part (with ``draft_bytes`` of draft model) where it coordinates. ``at_load``: before any
    session (no KV, no activations: the module doc)."""
    start, end = block
    n = 0 if at_load else spec.sessions if sessions is None else sessions
    peak = sum(spec.weights[start:end]) + (end - start) * spec.session_kv_bytes_per_layer * n
    if end > start and not at_load:
        peak += spec.transient_at(n)
    if coordinator:
        peak += spec.coordinator_at(n) + draft_bytes
    return peak


def sessions_that_fit(
    spec: ModelSpec, memory_bytes: int, block: tuple[int, int], *, coordinator: bool, draft_bytes: int = 0
) -> int | None:
    """How many sessions' KV fit beside the rest of ``predicted_peak`` in ``memory_bytes`` (may be
    0 or negative when even the weights do not fit); None when a session costs nothing here."""
    per_session = (block[1] - block[0]) * spec.session_kv_bytes_per_layer + (spec.inflight_bytes if block[1] > block[0] else 0)
    per_session += spec.head_session_bytes() if coordinator else 0
    if per_session <= 0:
        return None
    base = predicted_peak(spec, block, coordinator=coordinator, draft_bytes=draft_bytes, sessions=0)
    return (memory_bytes - base) // per_session


def runtime_overhead(device_kind: str, layer_load_bytes: int, *, coordinator: bool = True, tokenizer_bytes: int = 0) -> int:
    """This peer's overhead (real bytes) outside the planned part: see the module doc. The default,
    ``coordinator``, is what an advert leaves out (a peer may be chosen to coordinate), with its
    tokenizer's ``tokenizer_bytes`` beyond the TOKENIZER_IN_RUNTIME that constant holds."""
    if device_kind == "cuda":
        return 0
    coordinating = COORDINATOR_RUNTIME_BYTES + max(0, tokenizer_bytes - TOKENIZER_IN_RUNTIME)
    return RUNTIME_BYTES + layer_load_bytes + (coordinating if coordinator else 0)
