"""Sans-IO wire protocol: frames, messages and limits. No trio, no libp2p, no torch, no numpy.

Files:

- ``limits.py``    protocol IDs (``/shard-swarm/{admit,ctl,act}/1``) and :class:`Limits`, the caps
                   every decoder takes
- ``frame.py``     the binary frame (32-byte header, dims, JSON meta, raw tensor bytes),
                   ``encode_frame``, the incremental ``FrameDecoder`` and ``decode_frame``
- ``messages.py``  typed, strictly validated messages (admission, advert, heartbeat, plan, chunk,
                   result, rollback, session end, error) and ``parse_message``
- ``signing.py``   canonical JSON, Ed25519 sign/verify helpers, peer ID of a public key
- ``signed.py``    ``sign_advert``/``verify_advert``/``AdvertBook`` and ``sign_plan``/``verify_plan``
- ``control.py``   CONTROL: ring set-up / generation / status requests (``op`` + JSON body + optional
                   INT32 token ids), read through ``Body`` (written by the ring work)
- ``admission.py`` the challenge-response admission handshake as sans-IO ``Initiator``/``Responder``

Errors: FrameError for a bad frame, ProtocolError for a bad message, AdmissionError for a failed
proof (all from ``swarm.errors``).
"""

from swarm.proto.control import Control  # registers the CONTROL message type
from swarm.proto.frame import DType, Flag, Frame, FrameDecoder, MsgType, decode_frame, encode_frame
from swarm.proto.limits import DEFAULT_LIMITS, PROTO_ACT, PROTO_ADMIT, PROTO_CTL, Limits
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
    "DEFAULT_LIMITS", "PROTO_ACT", "PROTO_ADMIT", "PROTO_CTL", "AdmitChallenge", "AdmitHello",
    "AdmitResponse", "AdmitResult", "Advert", "Chunk", "Control", "DType", "Error", "Flag", "Frame", "FrameDecoder",
    "Heartbeat", "Limits", "Message", "MsgType", "Plan", "Result", "Rollback", "SessionEnd",
    "decode_frame", "decode_message", "encode_frame", "parse_message",
]  # fmt: skip
