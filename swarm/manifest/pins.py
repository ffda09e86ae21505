"""Trust on first use for invite issuers: the first invite a machine joins a swarm with pins
that swarm's issuer key; a later invite for the same swarm ID signed by another key is refused.

An invite carries its issuer's public key and is valid when it verifies against that key, so
without a pin anyone who learns a swarm's ID (it is in every status and advert) could hand a
friend a look-alike invite of their own. The pins live in ``<config dir>/pins.json``
(``{"version": 1, "pins": {swarm_id: {"issuer": peer_id, "name": ..., "first_used": unix}}}``),
written 0600; ``shard-swarm invite pin FILE --replace`` moves a pin on purpose.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from swarm.manifest.identity import config_dir, write_private_file
from swarm.manifest.schema import Manifest, ManifestInvalid, Reason

PINS_FILE = "pins.json"
MAX_PINS = 1024


def pins_path() -> Path:
    return config_dir() / PINS_FILE


def _load(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_bytes()[: 1 << 20])
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ManifestInvalid(Reason.MALFORMED, f"cannot read the issuer pins {path}: {exc}") from None
    pins = data.get("pins") if isinstance(data, dict) else None
    if not isinstance(pins, dict):
        raise ManifestInvalid(Reason.MALFORMED, f"{path}: expected {{'version': 1, 'pins': {{...}}}}")
    return {k: v for k, v in pins.items() if isinstance(k, str) and isinstance(v, dict)}


def pinned_issuer(manifest: Manifest, path: Path | None = None) -> str | None:
    """The issuer peer ID pinned for this invite's swarm, or None."""
    entry = _load(path or pins_path()).get(manifest.swarm_id)
    issuer = entry.get("issuer") if entry else None
    return issuer if isinstance(issuer, str) else None


def check_pin(manifest: Manifest, path: Path | None = None, *, replace: bool = False) -> bool:
    """Pin the invite's issuer on first use; ManifestInvalid(WRONG_ISSUER) if the swarm is pinned
    to another issuer (unless ``replace``). True when this call wrote a new pin."""
    path = path or pins_path()
    pins = _load(path)
    entry = pins.get(manifest.swarm_id)
    if entry is not None and entry.get("issuer") == manifest.issuer_peer_id:
        return False
    if entry is not None and not replace:
        raise ManifestInvalid(
            Reason.WRONG_ISSUER,
            f"swarm {manifest.swarm_name!r} ({manifest.swarm_id}) was first joined on this machine with an "
            f"invite from issuer {entry.get('issuer')}; this one is signed by {manifest.issuer_peer_id}. "
            "If your friend really re-issued it with a new key, run `shard-swarm invite pin FILE --replace`",
            "issuer",
        )
    if len(pins) >= MAX_PINS and manifest.swarm_id not in pins:
        oldest = min(pins, key=lambda k: pins[k].get("first_used", 0) if isinstance(pins[k].get("first_used"), int) else 0)
        del pins[oldest]
    pins[manifest.swarm_id] = {
        "issuer": manifest.issuer_peer_id, "name": manifest.swarm_name, "first_used": int(time.time()),
    }  # fmt: skip
    try:
        write_private_file(path, json.dumps({"version": 1, "pins": pins}, indent=2, sort_keys=True).encode() + b"\n")
    except OSError as exc:  # a read-only config dir: say so, the invite itself verified
        logging.getLogger("swarm.manifest").warning("could not pin the issuer in %s: %s", path, exc.strerror)
        return False
    return True
