"""``shard-swarm invite create|verify|show``: make, check and read swarm invite manifests.

Exit codes: 0 valid / done; 2 usage error (bad flag, bad duration, output exists); 3 the local
model differs from the invite (``verify --model``); 4 the invite (or the key file) is refused:
the message names the reason word (see ``manifests/README.md``) and the field.
The swarm secret is never printed: ``show`` leaves it out and every repr hides it.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import typer

from swarm.cli import ui
from swarm.cli.draftflag import describe_draft
from swarm.errors import UsageError
from swarm.manifest.identity import load_or_create_identity, public_key_from_peer_id
from swarm.manifest.manifest import (
    new_manifest,
    read_manifest,
    sign_manifest,
    verify_manifest,
    write_manifest,
)
from swarm.manifest.modelcheck import check_model, describe_model
from swarm.manifest.pins import check_pin, pinned_issuer, pins_path
from swarm.manifest.schema import (
    DEFAULT_CONTEXT,
    KV_CACHES,
    MAX_CONTEXT,
    MIN_CONTEXT,
    QUANTS,
    Manifest,
    ManifestInvalid,
    SwarmSecret,
)
from swarm.proto.admission import client_secret, member_key

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int:
    """'30d', '12h', '90m', '3600s', '2w' -> seconds (UsageError otherwise)."""
    m = re.fullmatch(r"\s*(\d{1,9})\s*([smhdw])\s*", text)
    if not m or int(m.group(1)) == 0:
        raise UsageError(f"--expires {text!r}: expected a positive duration like 30d, 12h, 90m, 2w")
    return int(m.group(1)) * _UNITS[m.group(2)]


def _iso(t: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _status(m: Manifest) -> tuple[str, str]:
    try:
        verify_manifest(m)
    except ManifestInvalid as exc:
        return exc.reason.value, str(exc)
    return "valid", ""


def create(
    swarm: str | None = typer.Option(
        None, "--swarm", help="Swarm name (letters, digits, space, . _ -); required without --from."
    ),
    model: Path | None = typer.Option(
        None, "--model", help="Model directory or file to pin by sha256."
    ),
    model_name: str | None = typer.Option(
        None, "--model-name", help="Name for the model (default: its file/dir name)."
    ),
    bootstrap: list[str] = typer.Option(
        [], "--bootstrap", help="Bootstrap/relay multiaddr (repeatable)."
    ),
    expires: str = typer.Option("30d", "--expires", help="Lifetime, e.g. 30d, 12h, 2w."),
    revoke: list[str] = typer.Option(
        [], "--revoke", help="Peer ID to exclude from the swarm (repeatable)."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Invite file to write (mode 0600)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing output file."),
    from_file: Path | None = typer.Option(
        None,
        "--from",
        help="Re-issue this invite (same swarm ID and secret; new expiry; --revoke adds to its list).",
    ),
    rotate_secret: bool = typer.Option(
        False,
        "--rotate-secret",
        help="With --from: a new swarm secret (every member needs the new invite).",
    ),
    quant: str | None = typer.Option(
        None, "--quant", help="How every peer holds its layers: none, int8, int4 or mxfp4 (MoE experts only; default none; --from keeps it)."
    ),
    context: int | None = typer.Option(
        None, "--context", min=MIN_CONTEXT, max=MAX_CONTEXT,
        help=f"The swarm's context in tokens (prompt + output of one generation; default {DEFAULT_CONTEXT}, at most the model's own; --from keeps it).",
    ),
    kv_cache: str | None = typer.Option(
        None, "--kv-cache", help="How every peer holds its KV cache: auto (the serving dtype), int8 or fp8 (about half the bytes; fp8 on CUDA sm89+ or a CPU) (default auto; --from keeps it)."
    ),
    draft: Path | None = typer.Option(
        None, "--draft", help="A draft model checkpoint a coordinator may run (hashed into the invite; --from keeps it)."
    ),
    model_manifest: Path | None = typer.Option(
        None, "--model-manifest", help="A model manifest (`shard-swarm model manifest`): peers fetch and verify only their slice."
    ),
    origin: list[str] = typer.Option(
        [], "--origin", help="With --model-manifest: base URL of the unmodified model files (Range requests; repeatable). "
        "None: the members serve them to each other (one joins with --model DIR)."
    ),
    manifest_url: str | None = typer.Option(
        None, "--manifest-url", help="With --model-manifest: where joining peers fetch the manifest itself."
    ),
    client: bool = typer.Option(
        False, "--client",
        help="With --from: a client invite (generate and status only; it holds a key derived from the secret, never the secret).",
    ),
) -> None:
    """Create a signed invite for a new swarm, or re-issue one with --from."""
    lifetime = parse_duration(expires)
    if output.exists() and not force:
        raise UsageError(f"{output} exists; pass --force to overwrite it")
    if swarm is None and from_file is None:
        raise UsageError("give --swarm NAME (a new swarm) or --from FILE (re-issue an invite)")
    if rotate_secret and from_file is None:
        raise UsageError(
            "--rotate-secret needs --from FILE (a new swarm always gets a fresh secret)"
        )
    if client and (from_file is None or rotate_secret):
        raise UsageError("--client needs --from MEMBER_INVITE (and no --rotate-secret): the client key is derived from that swarm's secret")
    if quant is not None and quant not in QUANTS:
        raise UsageError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    if kv_cache is not None and kv_cache not in KV_CACHES:
        raise UsageError(f"--kv-cache {kv_cache!r}: choose one of {', '.join(KV_CACHES)}")
    identity = load_or_create_identity()
    old = None
    if from_file is not None:
        old = read_manifest(from_file, expected_issuer=identity.public_key, allow_expired=True)
        if old.role != "member":
            raise UsageError(f"{from_file} is a client invite: re-issue from the member invite")
    spec = old.model if old is not None else None
    if model is not None:
        with ui.progress(f"hashing {model.name}") as report:
            spec = describe_model(model, model_name, report)
    if model_manifest is not None:
        if model is not None:
            raise UsageError("give --model (whole files by hash) or --model-manifest (every tensor by hash), not both")
        from swarm.cli.model import invite_spec

        spec = invite_spec(model_manifest, origin, manifest_url)
    elif origin or manifest_url:
        raise UsageError("--origin and --manifest-url come with --model-manifest")
    revoked = tuple(dict.fromkeys([*(old.revoked if old else ()), *revoke]))
    secret = old.secret if old and not rotate_secret else None
    extra: dict[str, Any] = {}
    if client and old is not None:
        extra = {"role": "client", "member_key": member_key(old.secret.value)}
        secret = SwarmSecret(client_secret(old.secret.value))
    m = new_manifest(
        swarm_name=swarm or (old.swarm_name if old else ""),
        issuer=identity.public_key,
        model=spec,
        bootstrap=tuple(bootstrap) or (old.bootstrap if old else ()),
        lifetime_s=lifetime,
        revoked=revoked,
        swarm_id=old.swarm_id if old else None,
        secret=secret,
        quant=quant or (old.quant if old else "none"),
        context=context if context is not None else (old.context if old else None),
        kv_cache=kv_cache or (old.kv_cache if old else "auto"),
        draft=describe_draft(draft) or (old.draft if old else None),
        **extra,
    )
    m = sign_manifest(m, identity)
    write_manifest(m, output)
    holds = ("a client key: its holder may generate and read status, nothing else" if client
             else "the swarm secret: share it only with members")  # fmt: skip
    ui.notice(
        f"wrote {output} (mode 0600): swarm {m.swarm_name!r} id {m.swarm_id}, issuer {m.issuer_peer_id}, "
        f"expires {_iso(m.expires)}. It holds {holds}."
    )


def verify(
    file: Path = typer.Argument(..., help="Invite file."),
    issuer: str | None = typer.Option(None, "--issuer", help="Require this issuer peer ID."),
    model: Path | None = typer.Option(
        None, "--model", help="Also check a local model against the invite."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Check an invite: exit 0 only when it is well-formed, signed, unexpired (and matches --issuer)."""
    expected = None
    if issuer is not None:
        try:
            expected = public_key_from_peer_id(issuer)
        except ValueError as exc:
            raise UsageError(f"--issuer: {exc}") from None
    try:
        m = read_manifest(file, expected_issuer=expected)
    except ManifestInvalid as exc:
        if as_json:
            ui.print_json(
                {
                    "valid": False,
                    "reason": exc.reason.value,
                    "field": exc.field,
                    "message": str(exc),
                }
            )
        raise  # main() prints it as one line on stderr and exits 4
    if model is not None:
        if m.model is None:
            raise UsageError(f"{file} pins no model; nothing to check --model against")
        with ui.progress(f"checking {model.name}") as report:
            check_model(m.model, model, report)
    if as_json:
        ui.print_json(
            {
                "valid": True,
                "swarm": m.swarm_name,
                "swarm_id": m.swarm_id,
                "issuer_peer_id": m.issuer_peer_id,
                "expires": m.expires,
                "role": m.role,
            }
        )
    else:
        ui.notice(
            f"{file}: valid invite for swarm {m.swarm_name!r}, issuer {m.issuer_peer_id}, expires {_iso(m.expires)}"
        )


def show(
    file: Path = typer.Argument(..., help="Invite file."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON on stdout."),
) -> None:
    """Print an invite without its secret (and whether it verifies)."""
    m = read_manifest(file, verify=False)
    status, why = _status(m)
    data: dict[str, Any] = m.public_dict()
    data["status"] = status
    pinned = pinned_issuer(m)
    data["issuer_pin"] = "none" if pinned is None else ("match" if pinned == m.issuer_peer_id else "mismatch")
    pin_text = {
        "none": "not pinned yet: the first `join` with it pins this issuer for the swarm",
        "match": "pinned on this machine (trust on first use)",
        "mismatch": f"MISMATCH: this machine pinned issuer {pinned} for this swarm; `join` refuses this invite",
    }[data["issuer_pin"]]
    if as_json:
        ui.print_json(data)
        return
    rows: list[list[Any]] = [
        ["swarm", f"{m.swarm_name} ({m.swarm_id})"],
        ["issuer", m.issuer_peer_id],
        ["issuer pin", pin_text],
        ["created", _iso(m.created)],
        ["expires", _iso(m.expires)],
        ["status", status if not why else f"{status}: {why}"],
        ["role", "member" if m.role == "member" else "client (generate and status only)"],
        ["secret", "(hidden)"],
    ]
    if m.model is not None:
        rows.append(
            [
                "model",
                f"{m.model.name}, {len(m.model.files)} file(s), config {m.model.config_sha256 or '-'}",
            ]
        )
    else:
        rows.append(["model", "(any)"])
    rows.append(["context", f"{m.context_tokens} tokens (at most the model's own)"])
    rows.append(["kv cache", m.kv_cache if m.kv_cache != "auto" else "auto (the serving dtype)"])
    rows.append(["quant", m.quant if m.quant != "none" else "none (layers in the serving dtype)"])
    rows.append(["draft", f"{m.draft.name} ({len(m.draft.files)} files)" if m.draft else "none named (peers choose: join --draft)"])
    if not m.bootstrap:
        rows.append(["bootstrap", "(none: LAN discovery only)"])
    rows += [["revoked", p] for p in m.revoked]
    ui.print_table(f"invite {file}", ["field", "value"], rows)
    # Multiaddrs are longer than a terminal's table cell: print them whole, one per line, so
    # they can be copied (a table would cut them with "…" or fold them).
    for a in m.bootstrap:
        sys.stdout.write(f"bootstrap: {a}\n")


def pin(
    file: Path = typer.Argument(..., help="Invite file."),
    replace: bool = typer.Option(False, "--replace", help="Replace a pin to another issuer (the issuer re-keyed)."),
) -> None:
    """Pin a verified invite's issuer for its swarm (what the first `join` does by itself)."""
    m = read_manifest(file)
    if check_pin(m, replace=replace):
        ui.notice(f"pinned issuer {m.issuer_peer_id} for swarm {m.swarm_name!r} in {pins_path()}")
    else:
        ui.notice(f"issuer {m.issuer_peer_id} is already pinned for swarm {m.swarm_name!r}")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Create, verify and show swarm invites.", no_args_is_help=True)
    group.command("create")(create)
    group.command("verify")(verify)
    group.command("show")(show)
    group.command("pin")(pin)
    app.add_typer(group, name="invite")
