"""Swarm invite manifests and node identity keys: canonical bytes, signing, verification.

Files:

- ``identity.py``   the node's Ed25519 key (32-byte seed, 0600 file in the config dir), peer IDs
                    (``peer_id_from_public_key``), ``verify_signature``, ``write_private_file``
- ``schema.py``     the types: ``Manifest``/``ModelSpec``/``SwarmSecret``, field bounds, ``Reason``,
                    ``ManifestInvalid``, canonical bytes
- ``manifest.py``   ``new_manifest``, ``sign_manifest``, ``parse_manifest`` (strict), ``verify_manifest``,
                    ``read_manifest``, ``write_manifest``; failures are ``ManifestInvalid`` with a ``Reason``
- ``modelcheck.py`` ``describe_model`` (hash a model for an invite), ``check_model`` (local copy vs invite)
- ``headers.py``  safetensors and GGUF tensor tables parsed from a file's first bytes (``NeedMore``)
- ``model_manifest.py`` ``ModelManifest``: every tensor's file, byte range and sha256, small files by
                  hash, the quant; canonical bytes and ``digest()``; built from any ``RangeReader``

The admission handshake that proves the swarm secret lives in ``swarm/proto/admission.py`` (its
frames are proto messages); pass it ``manifest.secret.value``, ``manifest.swarm_id`` and
``frozenset(manifest.revoked)``.
"""

from swarm.manifest.identity import (
    Identity,
    IdentityError,
    config_dir,
    default_key_path,
    load_identity,
    load_or_create_identity,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify_signature,
)
from swarm.manifest.manifest import (
    new_manifest,
    parse_manifest,
    read_manifest,
    sign_manifest,
    verify_manifest,
    write_manifest,
)
from swarm.manifest.schema import Manifest, ManifestInvalid, ModelSpec, Reason, SwarmSecret

__all__ = [
    "Identity", "IdentityError", "Manifest", "ManifestInvalid", "ModelSpec", "Reason", "SwarmSecret",
    "config_dir", "default_key_path", "load_identity", "load_or_create_identity", "new_manifest",
    "parse_manifest", "peer_id_from_public_key", "public_key_from_peer_id", "read_manifest",
    "sign_manifest", "verify_manifest", "verify_signature", "write_manifest",
]  # fmt: skip
