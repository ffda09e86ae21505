"""What an invite manifest holds, as types: the fields and their bounds, the refusal reasons,
the secret that never prints, the model spec, and the signed bytes (canonical JSON).

manifest.py builds, signs, parses and verifies manifests of these types (its docstring has the
format and the rules); everything here is data and pure functions.
"""

from __future__ import annotations

import base64
import enum
import hmac
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import ManifestError
from swarm.manifest.identity import peer_id_from_public_key
from swarm.strictjson import canonical

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 * 1024
SIGN_DOMAIN = b"shard-swarm/manifest/1\0"
SECRET_BYTES = 32
MAX_UNIX_S = 253_402_300_799  # 9999-12-31T23:59:59Z: the last second a date can be printed for
CLOCK_SKEW_S = 300  # a manifest "created" up to this far in the future is still accepted
MAX_BOOTSTRAP = 32
MAX_FILES = 1024
MAX_REVOKED = 1024
HEX64 = re.compile(r"[0-9a-f]{64}")
HEX32 = re.compile(r"[0-9a-f]{32}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}")
FIELDS = {
    "version",
    "swarm",
    "model",
    "bootstrap",
    "secret",
    "issuer",
    "created",
    "expires",
    "revoked",
    "quant",
    "context",
    "kv_cache",
    "draft",
    "role",
    "member_key",
    "signature",
}
OPTIONAL_FIELDS = {"revoked", "quant", "context", "kv_cache", "draft", "role", "member_key", "signature"}
ROLES = ("member", "client")  # "member" is never written (the field is absent)
# how every peer holds its layers (swarm.model.quant.QUANTS; a test keeps the two equal). "none"
# is never written, so invites made before the field existed keep their exact bytes and signature.
QUANTS = ("none", "int8", "int4", "mxfp4")
# the swarm's context in tokens (prompt + output of one generation): every peer reserves KV for it
# and every request is checked against it. Absent means DEFAULT_CONTEXT (capped by the model's own).
DEFAULT_CONTEXT = 8192
MIN_CONTEXT, MAX_CONTEXT = 64, 1 << 20
# how every peer holds its KV cache (swarm.model.kvcache.KV_FORMATS; a test keeps the two equal):
# "auto" (the serving dtype, the default, never written), int8 or fp8 with a scale per (token, head)
KV_CACHES = ("auto", "int8", "fp8")


class Reason(enum.Enum):
    """Why a manifest was refused (stable words, shown by ``invite verify --json``)."""

    MALFORMED = "malformed"  # not JSON, wrong type, missing/unknown field, bad value
    TOO_LARGE = "too-large"  # file over MAX_MANIFEST_BYTES
    UNKNOWN_VERSION = "unknown-version"  # "version" is not one this program reads
    UNSIGNED = "unsigned"  # no signature
    BAD_SIGNATURE = "bad-signature"  # tampered after signing, or signed by another key
    WRONG_ISSUER = "wrong-issuer"  # validly signed, but not by the issuer the caller expects
    NOT_YET_VALID = "not-yet-valid"  # created in the future (beyond the clock skew)
    EXPIRED = "expired"  # past "expires"


class ManifestInvalid(ManifestError):
    """A manifest failed a check; ``reason`` says which class, ``field`` which field (if one)."""

    def __init__(self, reason: Reason, message: str, field: str | None = None) -> None:
        super().__init__(f"{message} (reason: {reason.value})")
        self.reason = reason
        self.field = field


class SwarmSecret:
    """The 32-byte swarm secret. Shown as ``<hidden>``; read ``.value`` only to use it."""

    __slots__ = ("value",)

    def __init__(self, value: bytes) -> None:
        if len(value) != SECRET_BYTES:
            raise ValueError(f"a swarm secret is {SECRET_BYTES} bytes")
        self.value = value

    @classmethod
    def generate(cls) -> SwarmSecret:
        return cls(os.urandom(SECRET_BYTES))

    def __repr__(self) -> str:
        return "SwarmSecret(<hidden>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SwarmSecret) and hmac.compare_digest(self.value, other.value)

    def __hash__(self) -> int:
        return hash(("SwarmSecret", self.value))


MAX_ORIGINS = 8


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_sha256: str | None  # sha256 of config.json; None for single-file checkpoints (GGUF)
    files: dict[str, str]  # relative POSIX path -> sha256 hex (empty when a model manifest names it)
    # the model manifest's hash (swarm.manifest.model_manifest): every tensor by range and sha256;
    # with it, a peer fetches and verifies only its slice. Absent in older invites (same bytes).
    manifest_sha256: str | None = None
    origin: tuple[str, ...] = ()  # http(s) base URLs of the unmodified upstream files
    manifest_url: str | None = None  # where the model manifest itself can be fetched

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "config_sha256": self.config_sha256, "files": dict(self.files)}
        if self.manifest_sha256 is not None:
            out["manifest_sha256"] = self.manifest_sha256
            out["origin"] = list(self.origin)
            if self.manifest_url is not None:
                out["manifest_url"] = self.manifest_url
        return out


@dataclass(frozen=True)
class Manifest:
    swarm_name: str
    swarm_id: str  # 32 hex chars, random per swarm
    model: ModelSpec | None
    bootstrap: tuple[str, ...]
    secret: SwarmSecret
    issuer: bytes  # Ed25519 public key
    created: int
    expires: int
    revoked: tuple[str, ...] = ()
    signature: bytes | None = None
    version: int = FORMAT_VERSION
    quant: str = "none"
    context: int | None = None  # the swarm's context in tokens; None: DEFAULT_CONTEXT
    kv_cache: str = "auto"  # how every peer holds its KV cache (KV_CACHES)
    # a draft model a coordinator may run (hashed like the model); absent in older invites
    draft: ModelSpec | None = None
    role: str = "member"  # "client": ``secret`` is the client secret, ``member_key`` is set
    member_key: bytes = b""
    # the body exactly as parsed from a file (what the signature covers); None when built here
    raw_body: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def context_tokens(self) -> int:
        """The swarm's context (tokens); the model's own maximum may cap it further."""
        return DEFAULT_CONTEXT if self.context is None else self.context

    @property
    def issuer_peer_id(self) -> str:
        return peer_id_from_public_key(self.issuer)

    def body(self) -> dict[str, Any]:
        """Everything but the signature (secret included): what is signed."""
        if self.raw_body is not None:
            return self.raw_body
        out: dict[str, Any] = {
            "version": self.version,
            "swarm": {"name": self.swarm_name, "id": self.swarm_id},
            "model": None if self.model is None else self.model.to_json(),
            "bootstrap": list(self.bootstrap),
            "secret": _b64e(self.secret.value),
            "issuer": _b64e(self.issuer),
            "created": self.created,
            "expires": self.expires,
        }
        if self.revoked:
            out["revoked"] = list(self.revoked)
        if self.quant != "none":
            out["quant"] = self.quant
        if self.context is not None:
            out["context"] = self.context
        if self.kv_cache != "auto":
            out["kv_cache"] = self.kv_cache
        if self.draft is not None:
            out["draft"] = self.draft.to_json()
        if self.role != "member":
            out["role"] = self.role
            out["member_key"] = _b64e(self.member_key)
        return out

    def signed_bytes(self) -> bytes:
        return SIGN_DOMAIN + canonical_bytes(self.body())

    def to_json_bytes(self) -> bytes:
        """The file form: sorted, indented JSON (whitespace is not covered by the signature)."""
        obj = dict(self.body())
        if self.signature is not None:
            obj["signature"] = _b64e(self.signature)
        return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode(
            "utf-8"
        )

    def public_dict(self) -> dict[str, Any]:
        """For display: everything except the secret."""
        return {
            "version": self.version,
            "swarm": {"name": self.swarm_name, "id": self.swarm_id},
            "model": None if self.model is None else self.model.to_json(),
            "bootstrap": list(self.bootstrap),
            "issuer": _b64e(self.issuer),
            "issuer_peer_id": self.issuer_peer_id,
            "created": self.created,
            "expires": self.expires,
            "revoked": list(self.revoked),
            "quant": self.quant,
            "context": self.context_tokens,
            "kv_cache": self.kv_cache,
            "draft": None if self.draft is None else self.draft.to_json(),
            "role": self.role,
            "signed": self.signature is not None,
        }


def canonical_bytes(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8; floats refused (integers only)."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            raise ManifestInvalid(
                Reason.MALFORMED, "manifest: floats are not allowed (integers only)"
            )
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return canonical(obj)


def _b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------- creating and signing
