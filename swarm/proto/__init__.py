"""Sans-IO wire protocol: frames, messages and limits. No trio, no libp2p, no torch, no numpy.

Files:

- ``limits.py``     every protocol ID (``/shard-swarm/{admit,ctl,act,ring,gen,tensors}/1``) and
                    :class:`Limits`, the caps every decoder takes
- ``frame.py``      the binary frame (32-byte header, dims, JSON meta, raw tensor bytes),
                    ``encode_frame``, the incremental ``FrameDecoder`` and ``decode_frame``, and
                    the JSON metadata block (``encode_meta``/``decode_meta``), strictly bounded
                    both ways
- ``fields.py``     the declarative field codec: a message lists its fields once (wire key,
                    bounds), encoding and strict decoding come from that list
- ``messages.py``   the message base, ``parse_message``, ``MessageIO`` (typed send/receive that
                    every link and stream mixes in: the one place a message becomes a frame and
                    back), the swarm-level messages (admission, advert, heartbeat, plan) and the
                    activation path's (chunk, result, rollback, session end, error)
- ``control.py``    CONTROL: one typed message per ring / generation / status op, the one
                    generation request (``Gen``) and its bounds, ``Fail`` and its error codes
- ``parts.py``      long messages in small frames: a prompt or receipt as PART frames, then the
                    message (``pieces_of``), joined and bounded by an ``Assembler``
- ``signing.py``    canonical JSON, Ed25519 sign/verify helpers, peer ID of a public key
- ``signed.py``     ``sign_advert``/``verify_advert``/``AdvertBook`` and ``sign_plan``/``verify_plan``
- ``tensors.py``    /shard-swarm/tensors/1: a model file's byte range asked of a member
                    (RANGE_REQUEST), answered in RANGE_DATA pieces or a typed RANGE_REFUSED
- ``admission.py``  the challenge-response admission handshake as sans-IO ``Initiator``/``Responder``

Errors: FrameError for a bad frame, ProtocolError for a bad message, AdmissionError for a failed
proof (all from ``swarm.errors``).
"""

from swarm.proto import control, tensors  # noqa: F401  (register their message types)
from swarm.proto.control import Control
from swarm.proto.frame import DType, Flag, Frame, FrameDecoder, MsgType, decode_frame, encode_frame
from swarm.proto.limits import (
    DEFAULT_LIMITS,
    PROTO_ACT,
    PROTO_ADMIT,
    PROTO_CTL,
    PROTO_GEN,
    PROTO_RING,
    Limits,
)
from swarm.proto.messages import (
    AdmitChallenge,
    AdmitHello,
    AdmitResponse,
    AdmitResult,
    Advert,
    Chunk,
    Error,
    Heartbeat,
    Message,
    Plan,
    Result,
    Rollback,
    SessionEnd,
    decode_message,
    parse_message,
)

__all__ = [
    "DEFAULT_LIMITS", "PROTO_ACT", "PROTO_ADMIT", "PROTO_CTL", "PROTO_GEN", "PROTO_RING", "AdmitChallenge",
    "AdmitHello", "AdmitResponse", "AdmitResult", "Advert", "Chunk", "Control", "DType", "Error", "Flag", "Frame",
    "FrameDecoder", "Heartbeat", "Limits", "Message", "MsgType", "Plan", "Result", "Rollback", "SessionEnd",
    "decode_frame", "decode_message", "encode_frame", "parse_message",
]  # fmt: skip
