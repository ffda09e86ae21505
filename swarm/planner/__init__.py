"""Pure, deterministic placement: peers + RTTs + model -> coordinator, ring order, layer blocks.

No I/O, no trio, no torch: every peer runs the same function on the same numbers and gets the
same plan.

    spec.py      ModelSpec (layers and each layer's bytes, KV, coordinator part), Peer (with what it holds
                 on disk and its disk budget), Latency (RTT -> one-way hops)
    budget.py    one memory budget per peer: predicted_peak (the planned part), the per-peer overhead
    plan.py      Plan (the output; to_json / from_json), check_blocks
    alloc.py     layer counts per stage: fit memory, minimise compute, balance equal-speed peers;
                 exact counts for a ring order when layers differ in size (allocate_exact)
    search.py    coordinator + subset + ring order: exact Held-Karp up to 10 peers, local search beyond;
                 fewest_moves: among near-fastest placements, the one moving the fewest bytes
    sticky.py    re-planning after loss or join that keeps survivors' blocks; layers moved
    planner.py   plan(): the entry point, with the error messages and the "fewer peers" note;
                 fits(): whether the peers' memory holds the model at all
    peersfile.py the peers-file JSON format (the one a running swarm exports) -> peers + latencies
    examples/    friends.json: five machines' peers file to try `shard-swarm plan --peers` on
"""

from swarm.planner.peersfile import PeersFile, dump_peers_file, parse_peers_file
from swarm.planner.plan import Plan
from swarm.planner.planner import fits, plan
from swarm.planner.spec import GB, Latency, ModelSpec, Peer

__all__ = [
    "GB",
    "Latency",
    "ModelSpec",
    "Peer",
    "PeersFile",
    "Plan",
    "dump_peers_file",
    "fits",
    "parse_peers_file",
    "plan",
]
