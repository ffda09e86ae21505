"""Protocol IDs and the explicit caps every decoder takes.

Every size a remote peer can choose is bounded by a field of :class:`Limits`, checked before any
allocation. Decoders take a ``Limits`` argument (default :data:`DEFAULT_LIMITS`); tests pass tighter
ones to reach each cap cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

# Versioned libp2p protocol IDs, the only place they are written. A breaking change to a
# protocol bumps its trailing number.
PROTO_ADMIT = "/shard-swarm/admit/1"  # admission handshake (hello/challenge/response/result)
PROTO_CTL = "/shard-swarm/ctl/1"  # adverts and heartbeats
PROTO_ACT = "/shard-swarm/act/1"  # activation/verify chunks, results, rollbacks, errors
PROTO_RING = "/shard-swarm/ring/1"  # plans and the ring's set-up and recovery (control.py)
PROTO_GEN = "/shard-swarm/gen/1"  # generation requests and status (control.py)
PROTO_TENSORS = "/shard-swarm/tensors/1"  # byte ranges of model files a member holds verified (tensors.py)
PROTOCOL_IDS = (PROTO_ADMIT, PROTO_CTL, PROTO_ACT, PROTO_RING, PROTO_GEN, PROTO_TENSORS)

WIRE_VERSION = 1  # the frame header's version byte


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on everything a peer sends. All sizes are in bytes unless named otherwise."""

    max_frame_bytes: int = 32 * 1024 * 1024  # header + dims + meta + payload
    max_meta_bytes: int = 64 * 1024  # the JSON metadata block
    max_ndim: int = 4  # tensor rank
    max_dim: int = 1 << 24  # any one tensor dimension
    max_elements: int = 16 * 1024 * 1024  # product of the shape
    max_tokens_per_chunk: int = 512  # T in an activation/verify chunk
    max_position: int = 1 << 20  # base position + T of a chunk, rollback length
    max_batch: int = 64  # B in a chunk
    max_json_depth: int = 8  # nesting of the metadata JSON
    max_string: int = 4096  # any one JSON string (after decoding)
    max_list: int = 1024  # any one JSON array or object
    max_addresses: int = 16  # multiaddrs in an advert
    max_peers: int = 256  # RTT entries in an advert
    max_range_bytes: int = 16 * 1024 * 1024  # one byte-range request on /shard-swarm/tensors/1
    max_range_chunk: int = 1024 * 1024  # one RANGE_DATA frame's payload

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()
