"""One error tree for the whole project, mapped to exit codes at the CLI boundary.

Every error a user can meet derives from :class:`SwarmError`. Messages name what went wrong and
where (file, tensor, peer, limit) and, where there is one, what to do about it. Foreign exceptions
(libp2p, safetensors, gguf, json) are translated once, at the edge of the subpackage that calls the
foreign library, so callers above never catch a third-party exception type.

Exit codes (documented in the README):

    1   unexpected internal error (a bug: please report it)
    2   usage error (bad flags or arguments)
    3   model error (config, weights, tokenizer)
    4   manifest error (tampered, expired, unsigned, malformed invite)
    5   planning error (the swarm cannot hold the model, or cannot form a ring)
    6   protocol error (a peer sent something malformed)
    7   peer error (timeout, lost peer, refused admission)
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error this project raises on purpose."""

    exit_code = 1


class UsageError(SwarmError):
    exit_code = 2


class BadRequest(UsageError):
    """A request (a generation's parameters, say) is out of bounds; ``field`` names the one."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class ContextTooLong(BadRequest):
    """A request's prompt plus the tokens it asks for exceed the swarm's context (OpenAI's
    ``context_length_exceeded``)."""


class RequestRefused(SwarmError):
    """A peer could not serve this one request (it ran out of memory on it, say): the request
    fails, the ring and the peer stay as they are (no re-plan, nobody blamed)."""

    exit_code = 7


class ModelError(SwarmError):
    """Problems with a checkpoint, its config or its tokenizer."""

    exit_code = 3


class ConfigError(ModelError):
    """config.json is missing a field, names an unsupported architecture, or disagrees."""


class WeightsError(ModelError):
    """A tensor file is missing, truncated, corrupt, or holds a tensor of the wrong shape."""


class TokenizerError(ModelError):
    pass


class ManifestError(SwarmError):
    """A swarm invite manifest failed verification."""

    exit_code = 4


class PlanningError(SwarmError):
    """No placement exists: too little memory, or no ring without missing edges."""

    exit_code = 5


class ProtocolError(SwarmError):
    """A remote peer sent bytes that break the wire protocol (its fault, not ours)."""

    exit_code = 6


class FrameError(ProtocolError):
    """A frame is malformed, truncated, over a size cap, or of an unknown version/type."""


class BadMessage(ProtocolError):
    """A whole frame that is no valid message, or not the one expected. The stream it came on is
    still sound, so the receiver may answer this one (``session``, ``seq``: its frame's header)
    and go on reading."""

    def __init__(self, message: str, session: int = 0, seq: int = 0) -> None:
        super().__init__(message)
        self.session = session
        self.seq = seq


class Forbidden(ProtocolError):
    """A well-formed request from a party not entitled to send it (its role does not allow it)."""


class PeerError(SwarmError):
    """Talking to another peer failed."""

    exit_code = 7


class PeerTimeout(PeerError):
    """A peer did not answer within its deadline."""


class CannotServe(PeerError):
    """The swarm answered, but its live peers cannot hold the model right now (a client may
    retry later; resuming a generation now is pointless)."""


class Busy(PeerError):
    """Every slot of the ring is taken and its queue is full: try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PeerLost(PeerError):
    """A peer closed its connection or was declared dead by the failure detector."""


class FaultyPeer(PeerError):
    """A peer sent something it must not (NaN activations, malformed tensors): it is to be
    dropped from the ring, not merely waited for."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer


class AdmissionError(PeerError):
    """A peer could not prove it holds the swarm secret, or is revoked."""
