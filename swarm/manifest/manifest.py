"""Swarm invite manifests: making, signing, parsing and verifying them (their types: schema.py).

Theory of operation
-------------------
An invite is a JSON object (see ``manifests/schema.json`` and ``manifests/README.md``)::

    {"version": 1, "swarm": {"name", "id"}, "model": null | {"name", "config_sha256", "files",
               "manifest_sha256", "origin": [url], "manifest_url" (these three optional)},
     "bootstrap": [multiaddr, ...], "secret": b64(32 bytes), "issuer": b64(Ed25519 public key),
     "created": unix s, "expires": unix s, "revoked": [peer ID, ...] (optional),
     "quant": "int8" | "int4" (optional; absent means "none"),
     "context": tokens (optional; absent means 8192, capped by the model's own maximum),
     "kv_cache": "int8" | "fp8" (optional; absent means "auto": the KV cache in the serving dtype),
     "draft": {"name", "config_sha256", "files"} (optional: a draft model the coordinator may run),
     "role": "client", "member_key": b64(32 bytes) (both or neither), "signature": b64}

A *client* invite (``role: "client"``) lets its holder run generations and read status only:
its ``secret`` is the client secret derived one way from the swarm secret, so holding it never
reveals the swarm secret, and ``member_key`` is the public key with which the client checks that
a peer holds the swarm secret (see ``swarm.proto.admission``). A member invite has neither field,
so invites made before clients existed keep their exact bytes and signature.

The signature is Ed25519 by ``issuer`` over ``b"shard-swarm/manifest/1\\0" + canonical(body)``,
where body is the object minus ``signature`` *exactly as parsed* and canonical means sorted keys,
no whitespace, UTF-8, integers only. So the file may be pretty-printed or re-indented freely, but
changing, adding or removing any field breaks the signature. Parsing is strict (size cap, UTF-8,
no duplicate keys, no floats/NaN, every field typed and bounded, unknown fields refused) and
happens before any cryptography; times are judged only after the signature holds.

Every failure is a :class:`ManifestInvalid` (a ManifestError: CLI exit code 4) carrying a
``reason`` word from :class:`Reason` (documented in ``manifests/README.md``) and the field.
The secret is held in a :class:`SwarmSecret`, whose repr and str never show it.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from swarm.manifest.identity import Identity, is_peer_id, peer_id_from_public_key, verify_signature
from swarm.manifest.schema import (
    CLOCK_SKEW_S,
    FIELDS,
    FORMAT_VERSION,
    HEX32,
    HEX64,
    KV_CACHES,
    MAX_BOOTSTRAP,
    MAX_CONTEXT,
    MAX_FILES,
    MAX_MANIFEST_BYTES,
    MAX_ORIGINS,
    MAX_REVOKED,
    MAX_UNIX_S,
    MIN_CONTEXT,
    NAME_RE,
    OPTIONAL_FIELDS,
    QUANTS,
    SECRET_BYTES,
    Manifest,
    ManifestInvalid,
    ModelSpec,
    Reason,
    SwarmSecret,
)
from swarm.strictjson import unique_keys


def new_manifest(
    *,
    swarm_name: str,
    issuer: bytes,
    model: ModelSpec | None = None,
    bootstrap: tuple[str, ...] = (),
    lifetime_s: int = 30 * 86400,
    now: int | None = None,
    revoked: tuple[str, ...] = (),
    swarm_id: str | None = None,
    secret: SwarmSecret | None = None,
    quant: str = "none",
    draft: ModelSpec | None = None,
    role: str = "member",
    member_key: bytes = b"",
    context: int | None = None,
    kv_cache: str = "auto",
) -> Manifest:
    """A fresh, unsigned manifest with a random swarm ID and secret (unless given: re-issuing)."""
    now = int(time.time()) if now is None else now
    if lifetime_s <= 0:
        raise ManifestInvalid(
            Reason.MALFORMED, "manifest: the lifetime must be positive", "expires"
        )
    m = Manifest(
        swarm_name=swarm_name,
        swarm_id=swarm_id or os.urandom(16).hex(),
        model=model,
        bootstrap=tuple(bootstrap),
        secret=secret or SwarmSecret.generate(),
        issuer=issuer,
        created=now,
        expires=now + lifetime_s,
        revoked=tuple(revoked),
        quant=quant,
        context=context,
        kv_cache=kv_cache,
        draft=draft,
        role=role,
        member_key=member_key,
    )
    # round-trip through the strict parser: we never write what we would refuse
    _parse_obj(json.loads(m.to_json_bytes()), "new manifest")
    return m


def sign_manifest(manifest: Manifest, identity: Identity) -> Manifest:
    if identity.public_key != manifest.issuer:
        raise ManifestInvalid(
            Reason.WRONG_ISSUER, "manifest: signing key is not the manifest's issuer", "issuer"
        )
    sig = identity.sign(manifest.signed_bytes())
    return Manifest(**{**manifest.__dict__, "signature": sig})


# ---------------------------------------------------------------- parsing


class _Reader:
    def __init__(self, where: str) -> None:
        self.where = where

    def bad(self, fld: str, why: str, reason: Reason = Reason.MALFORMED) -> ManifestInvalid:
        return ManifestInvalid(reason, f"{self.where}: field '{fld}': {why}", fld)

    def get_obj(
        self, v: Any, fld: str, keys: set[str], optional: frozenset[str] | set[str] = frozenset()
    ) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.bad(fld, f"expected an object, got {type(v).__name__}")
        missing = sorted(keys - optional - set(v))
        if missing:
            raise self.bad(f"{fld}.{missing[0]}" if fld else missing[0], "missing")
        unknown = sorted(set(v) - keys)
        if unknown:
            raise self.bad(f"{fld}.{unknown[0][:64]}" if fld else unknown[0][:64], "unknown field")
        return v

    def get_int(self, v: Any, fld: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_UNIX_S:
            raise self.bad(fld, f"expected unix seconds from 0 to {MAX_UNIX_S} (year 9999), got {_show(v)}")
        return v

    def get_str(
        self, v: Any, fld: str, max_len: int = 256, pattern: re.Pattern[str] | None = None
    ) -> str:
        if not isinstance(v, str) or not 0 < len(v) <= max_len:
            raise self.bad(fld, f"expected a string of 1..{max_len} chars, got {_show(v)}")
        if pattern is not None and not pattern.fullmatch(v):
            raise self.bad(fld, f"{_show(v)} does not match {pattern.pattern}")
        return v

    def get_b64(self, v: Any, fld: str, length: int) -> bytes:
        if not isinstance(v, str):
            raise self.bad(fld, f"expected base64 text, got {_show(v)}")
        try:
            raw = base64.b64decode(v.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise self.bad(fld, "not valid base64") from None
        if len(raw) != length:
            raise self.bad(fld, f"{len(raw)} bytes, expected {length}")
        return raw

    def get_list(self, v: Any, fld: str, max_len: int) -> list[Any]:
        if not isinstance(v, list) or len(v) > max_len:
            raise self.bad(fld, f"expected a list of at most {max_len} items")
        return v


def _show(v: Any) -> str:
    text = repr(v) if not isinstance(v, dict | list) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _reject_float(text: str) -> Any:
    raise ValueError(f"number {text[:20]} is not an integer (floats are not allowed)")


_no_dups = unique_keys(ValueError)


def parse_manifest(data: bytes, where: str = "manifest") -> Manifest:
    """Strictly parse manifest bytes (no signature or time checks: see :func:`verify_manifest`)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestInvalid(
            Reason.TOO_LARGE, f"{where}: {len(data)} bytes, over the limit of {MAX_MANIFEST_BYTES}"
        )
    try:
        text = data.decode("utf-8")
        obj = json.loads(
            text,
            object_pairs_hook=_no_dups,
            parse_float=_reject_float,
            parse_constant=_reject_float,
        )
    except UnicodeDecodeError as exc:
        raise ManifestInvalid(
            Reason.MALFORMED, f"{where}: not UTF-8 text (byte {exc.start})"
        ) from None
    except RecursionError:
        raise ManifestInvalid(Reason.MALFORMED, f"{where}: JSON nested too deeply") from None
    except ValueError as exc:
        raise ManifestInvalid(
            Reason.MALFORMED, f"{where}: not valid JSON ({str(exc)[:120]})"
        ) from None
    _no_lone_surrogates(obj, where)
    return _parse_obj(obj, where)


def _no_lone_surrogates(obj: Any, where: str, path: str = "") -> None:
    """JSON's \\uD800 escapes decode to lone surrogates, which no UTF-8 text (the signed bytes, a
    terminal) can hold: refused here, once for every string of the file, naming the field."""
    stack: list[tuple[str, Any]] = [(path, obj)]
    while stack:
        at, v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            sub = f"{at}[{k}]" if isinstance(k, int) else (f"{at}.{k}" if at else str(k))
            if isinstance(k, str) and _has_surrogate(k) or isinstance(x, str) and _has_surrogate(x):
                field = sub.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
                raise ManifestInvalid(Reason.MALFORMED, f"{where}: a lone surrogate (\\uD800-\\uDFFF) in {field}", field)
            stack.append((sub, x))


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _parse_obj(obj: Any, where: str) -> Manifest:
    r = _Reader(where)
    if not isinstance(obj, dict):
        raise ManifestInvalid(
            Reason.MALFORMED, f"{where}: expected a JSON object, got {type(obj).__name__}"
        )
    if "version" not in obj:
        raise r.bad("version", "missing")
    version = obj["version"]
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise r.bad(
            "version",
            f"{_show(version)} is not a version this program reads ({FORMAT_VERSION})",
            Reason.UNKNOWN_VERSION,
        )
    r.get_obj(obj, "", FIELDS, OPTIONAL_FIELDS)
    swarm = r.get_obj(obj["swarm"], "swarm", {"name", "id"})
    name = r.get_str(swarm["name"], "swarm.name", 64, NAME_RE)
    swarm_id = r.get_str(swarm["id"], "swarm.id", 32, HEX32)
    model = None if obj["model"] is None else _model_spec(r, obj["model"], "model")
    draft = None
    if "draft" in obj:
        if obj["draft"] is None:
            raise r.bad("draft", "null: omit the field when the swarm names no draft model")
        draft = _model_spec(r, obj["draft"], "draft")
    boots = tuple(r.get_list(obj["bootstrap"], "bootstrap", MAX_BOOTSTRAP))
    for i, a in enumerate(boots):
        if (
            not isinstance(a, str)
            or not a.startswith("/")
            or not 1 < len(a) <= 256
            or not a.isprintable()
        ):
            raise r.bad(
                f"bootstrap[{i}]",
                f"{_show(a)} is not a multiaddr (e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3...)",
            )
    secret = SwarmSecret(r.get_b64(obj["secret"], "secret", SECRET_BYTES))
    issuer = r.get_b64(obj["issuer"], "issuer", 32)
    created, expires = r.get_int(obj["created"], "created"), r.get_int(obj["expires"], "expires")
    if expires <= created:
        raise r.bad("expires", f"{expires} is not after created ({created})")
    revoked = tuple(r.get_list(obj.get("revoked", []), "revoked", MAX_REVOKED))
    for i, p in enumerate(revoked):
        if not isinstance(p, str) or not is_peer_id(p):
            raise r.bad(f"revoked[{i}]", f"{_show(p)} is not an Ed25519 libp2p peer ID")
    quant = obj.get("quant", "none")
    if "quant" in obj and (quant not in QUANTS[1:] or not isinstance(quant, str)):
        raise r.bad("quant", f"{_show(quant)} is not one of {', '.join(QUANTS[1:])} (omit it for none)")
    context = None
    if "context" in obj:
        context = obj["context"]
        if isinstance(context, bool) or not isinstance(context, int) or not MIN_CONTEXT <= context <= MAX_CONTEXT:
            raise r.bad("context", f"{_show(context)} is not a whole number of tokens in {MIN_CONTEXT}..{MAX_CONTEXT}")
    kv_cache = obj.get("kv_cache", "auto")
    if "kv_cache" in obj and (not isinstance(kv_cache, str) or kv_cache not in KV_CACHES[1:]):
        raise r.bad("kv_cache", f"{_show(kv_cache)} is not one of {', '.join(KV_CACHES[1:])} (omit it for auto)")
    role = obj.get("role", "member")
    if "role" in obj and role != "client":
        raise r.bad("role", f"{_show(role)} is not 'client' (omit it for a member invite)")
    if ("member_key" in obj) != ("role" in obj):
        raise r.bad("member_key", "a client invite carries both 'role' and 'member_key'; a member invite neither")
    member_key = r.get_b64(obj["member_key"], "member_key", 32) if "member_key" in obj else b""
    signature = None
    if obj.get("signature") is not None:
        signature = r.get_b64(obj["signature"], "signature", 64)
    body = {k: v for k, v in obj.items() if k != "signature"}
    return Manifest(
        name,
        swarm_id,
        model,
        boots,
        secret,
        issuer,
        created,
        expires,
        revoked,
        signature,
        version,
        quant=quant,
        context=context,
        kv_cache=kv_cache,
        draft=draft,
        role=role,
        member_key=member_key,
        raw_body=body,
    )


def _model_spec(r: _Reader, v: Any, fld: str) -> ModelSpec:
    """The invite's ``model`` (or ``draft``): a name, config.json's hash, every file's hash; or
    (``manifest_sha256``) the hash of a model manifest, its origin URLs and where to fetch it."""
    extra = {"manifest_sha256", "origin", "manifest_url"}
    mo = r.get_obj(v, fld, {"name", "config_sha256", "files"} | extra, extra)
    config_sha = None
    if mo["config_sha256"] is not None:
        config_sha = r.get_str(mo["config_sha256"], f"{fld}.config_sha256", 64, HEX64)
    by_manifest = "manifest_sha256" in mo
    files = mo["files"]
    if not isinstance(files, dict) or not (0 if by_manifest else 1) <= len(files) <= MAX_FILES:
        raise r.bad(f"{fld}.files", f"expected an object of 1..{MAX_FILES} files")
    for fname, digest in files.items():
        if not _safe_relpath(fname):
            raise r.bad(f"{fld}.files", f"{_show(fname)} is not a safe relative path")
        r.get_str(digest, f"{fld}.files['{fname}']", 64, HEX64)
    name = r.get_str(mo["name"], f"{fld}.name", 128)
    if not by_manifest:
        if set(mo) & extra:
            raise r.bad(f"{fld}.manifest_sha256", "missing (origin and manifest_url come with it)")
        return ModelSpec(name, config_sha, dict(files))
    digest = r.get_str(mo["manifest_sha256"], f"{fld}.manifest_sha256", 64, HEX64)
    origin = [r.get_str(u, f"{fld}.origin", 2048, _URL) for u in r.get_list(mo.get("origin", []), f"{fld}.origin", MAX_ORIGINS)]
    url = None if mo.get("manifest_url") is None else r.get_str(mo["manifest_url"], f"{fld}.manifest_url", 2048, _URL)
    return ModelSpec(name, config_sha, dict(files), digest, tuple(origin), url)


_URL = re.compile(r"https?://[^\s]+")


def _safe_relpath(name: Any) -> bool:
    if not isinstance(name, str) or not 0 < len(name) <= 255 or not name.isprintable():
        return False
    parts = name.split("/")
    return (
        not name.startswith("/")
        and "\\" not in name
        and all(p not in ("", ".", "..") for p in parts)
    )


# ---------------------------------------------------------------- verification


def verify_manifest(
    manifest: Manifest,
    *,
    now: int | None = None,
    expected_issuer: bytes | None = None,
    skew_s: int = CLOCK_SKEW_S,
    where: str = "manifest",
) -> None:
    """ManifestInvalid unless signed by its issuer (and by ``expected_issuer`` if given) and valid at ``now``."""
    if manifest.signature is None:
        raise ManifestInvalid(
            Reason.UNSIGNED,
            f"{where}: field 'signature': missing (the invite is unsigned)",
            "signature",
        )
    if not verify_signature(manifest.issuer, manifest.signed_bytes(), manifest.signature):
        raise ManifestInvalid(
            Reason.BAD_SIGNATURE,
            f"{where}: field 'signature': does not match the content: the invite was altered after "
            f"signing or signed by another key; ask the issuer for a fresh one",
            "signature",
        )
    if expected_issuer is not None and expected_issuer != manifest.issuer:
        raise ManifestInvalid(
            Reason.WRONG_ISSUER,
            f"{where}: field 'issuer': signed by {manifest.issuer_peer_id}, not by the expected "
            f"{peer_id_from_public_key(expected_issuer)}",
            "issuer",
        )
    now = int(time.time()) if now is None else now
    if manifest.created > now + skew_s:
        raise ManifestInvalid(
            Reason.NOT_YET_VALID,
            f"{where}: field 'created': {_iso(manifest.created)} is in the future (now {_iso(now)}); check the clock",
            "created",
        )
    if now >= manifest.expires:
        raise ManifestInvalid(
            Reason.EXPIRED,
            f"{where}: field 'expires': expired at {_iso(manifest.expires)} (now {_iso(now)}); ask the issuer for a new invite",
            "expires",
        )


def _iso(t: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def read_manifest(
    path: Path,
    *,
    verify: bool = True,
    now: int | None = None,
    expected_issuer: bytes | None = None,
    allow_expired: bool = False,
) -> Manifest:
    """Read, parse and (by default) verify a manifest file. Reads at most MAX_MANIFEST_BYTES + 1.
    ``allow_expired``: accept a validly signed but expired one (for re-issuing it)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
            mode = os.fstat(f.fileno()).st_mode
    except OSError as exc:
        raise ManifestInvalid(
            Reason.MALFORMED, f"cannot read invite {path}: {exc.strerror}"
        ) from None
    if mode & 0o077:
        logging.getLogger("swarm.manifest").warning(
            "invite %s is readable by other users (mode %o): it holds the swarm secret; chmod 600 it",
            path, mode & 0o777,
        )
    m = parse_manifest(data, where=str(path))
    if verify:
        try:
            verify_manifest(m, now=now, expected_issuer=expected_issuer, where=str(path))
        except ManifestInvalid as exc:
            if not (allow_expired and exc.reason is Reason.EXPIRED):
                raise
    return m


def write_manifest(manifest: Manifest, path: Path) -> None:
    """Write the file form with mode 0600 (it holds the swarm secret)."""
    from swarm.manifest.identity import write_private_file

    write_private_file(path, manifest.to_json_bytes())
