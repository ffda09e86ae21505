"""``shard-swarm join``: run a node that joins a swarm and shows its peers as they appear.

The node reads the invite (``--manifest``, default ``<config dir>/invite.json``), verifies it,
starts a libp2p host under the node's identity key, dials the invite's bootstrap addresses (and,
with mDNS on, peers announced on the LAN), is admitted with the swarm secret, and then prints one
line per membership change on stdout (``--json``: one JSON object per line): peer, address, how it
was reached (we dialed / it dialed us; direct or relayed) and the measured RTT. Notices go to
stderr. Ctrl-C (or SIGTERM) leaves cleanly within a bound: the members hear that this node
leaves (a leaving leader hands leadership to the next one), the leader re-plans once without it
if it held part of the ring, and the process exits 0 at most LEAVE_TIMEOUT_S (5 s) plus the
host's close (about a second) after the signal, whatever the others do. With ``--json`` the
node's life comes as events too: ``plan`` (epoch, role, block, coordinator, ring, cause,
pause_s), ``loading`` (layers, done, seconds), ``compiled`` (with ``--compile``: layers, spans,
eager_from, seconds, or eager and why), ``serving``, ``waiting`` (why it cannot plan yet,
once per reason), ``replan`` (the epoch that ended and why), ``leaving`` and ``handover``.

``--diagnose`` checks reachability instead (swarm.net.nat: dial-back through a bootstrap node,
NAT kind, relay reservation) and prints the report and what to do about it.

Exit codes: 0 left cleanly; 2 bad flags; 4 invite refused; 7 could not listen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import trio
import typer

from swarm.cli import ui
from swarm.cli.draftflag import JOIN_HELP, check_join_draft
from swarm.cli.settings import flag_help, node_settings
from swarm.errors import UsageError
from swarm.manifest.identity import config_dir, load_identity, load_or_create_identity
from swarm.manifest.manifest import read_manifest
from swarm.manifest.pins import check_pin
from swarm.manifest.schema import Manifest
from swarm.net.host import SwarmHost, open_host
from swarm.node.members.gossip import MemberEvent, MembershipService
from swarm.node.settings import NodeSettings, check_compile_span, compile_span_help

log = logging.getLogger("swarm.cli.join")

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", re.IGNORECASE)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """'24G' or '24GB' -> 24 * 10^9 bytes (every message says GB, decimal, as the planner does);
    '1.5GiB' -> 1.5 * 2^30; '1000000' -> bytes; 'auto' -> half the available memory."""
    if text.strip().lower() == "auto":
        from swarm.model.devices import host_available_bytes

        return host_available_bytes() // 2
    m = _SIZE.fullmatch(text)
    if not m:
        raise UsageError(f"--memory {text!r}: expected a size like 24G, 512M or 'auto'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** _POWER[m.group(2).lower()])


def _serving_device(flag: str | None) -> str:
    """--device, else the config file's node.device, else auto -> a device this machine has."""
    from swarm.cli.settings import chosen_device
    from swarm.model.devices import device_label

    return device_label(chosen_device(flag))


def offered_memory(text: str, device: str) -> int:
    """--memory for a serving node: a size, or 'auto' = what the device can hold (model/devices.py)."""
    if text.strip().lower() != "auto":
        return parse_size(text)
    import torch

    from swarm.model.devices import auto_memory_bytes

    return auto_memory_bytes(torch.device(device))


class _Printer:
    """Membership changes as stdout lines; RTTs filled in as they are measured."""

    def __init__(self, host: SwarmHost, as_json: bool) -> None:
        self.host = host
        self.as_json = as_json
        self.rtt_shown: dict[str, float] = {}
        self.path_shown: dict[str, str] = {}

    def path(self, peer: str) -> str:
        return self.host.path_label(peer)  # direct, hole-punched, relayed via <relay>

    def line(
        self, kind: str, peer: str, addr: str, how: str, rtt: float | None, reason: str = "", incarnation: int = 0
    ) -> None:
        path = self.path(peer) if kind not in ("left", "refused") else ""
        if self.as_json:
            obj: dict[str, Any] = {"event": kind, "peer": peer, "addr": addr, "how": how, "path": path,
                                   "rtt_ms": None if rtt is None else round(rtt, 3)}  # fmt: skip
            if reason:
                obj["reason"] = reason
            if incarnation:
                obj["incarnation"] = incarnation
            sys.stdout.write(json.dumps(obj) + "\n")
        else:
            rtt_s = "-" if rtt is None else f"{rtt:.2f} ms"
            extra = f"  ({reason})" if reason else ""
            sys.stdout.write(f"{kind:<8} {peer}  {addr or '-'}  {how or '-'} {path}  rtt {rtt_s}{extra}\n")
        sys.stdout.flush()

    def on_event(self, ev: MemberEvent) -> None:
        if ev.kind in ("joined", "rejoined", "left", "suspect", "refused"):
            self.line(ev.kind, ev.peer, ev.addr, ev.how, ev.rtt_ms, ev.reason, ev.incarnation)
            if ev.kind in ("left", "refused"):
                self.rtt_shown.pop(ev.peer, None)
                self.path_shown.pop(ev.peer, None)
            else:
                self.path_shown[ev.peer] = self.path(ev.peer)

    def refresh(self, service: MembershipService) -> None:
        """Print a peer again when its RTT is first known or has moved by more than 25% ("rtt"),
        and when the way we reach it changes ("path": relayed -> hole-punched, say)."""
        for peer in service.members():
            rtt = service.rtt_ms(peer)
            old = self.rtt_shown.get(peer)
            info = self.host.admission_info(peer)
            how = ("dialed" if info.outbound else "inbound") if info else ""
            path = self.path(peer)
            if path != self.path_shown.setdefault(peer, path):
                self.path_shown[peer] = path
                self.line("path", peer, info.addr if info else "", how, rtt)
            if rtt is not None and (old is None or abs(rtt - old) > 0.25 * old + 0.5):
                self.rtt_shown[peer] = rtt
                self.line("rtt", peer, info.addr if info else "", how, rtt)


async def _run_peer(settings: NodeSettings, manifest: Manifest, *, as_json: bool, exit_after: float | None,
                    api: str | None = None, api_token: str | None = None) -> None:  # fmt: skip
    """The node, built by the one composition root (swarm.node.peer): membership, and (with a
    model) its block or the coordinator role; the UI prints its peers and life as they change."""
    from swarm.node.notices import Hooks
    from swarm.node.peer import run_peer

    printer: _Printer | None = None

    def on_member(ev: MemberEvent) -> None:
        if printer is not None:
            printer.on_event(ev)

    def on_life(event: dict[str, Any]) -> None:
        if as_json:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    hooks = Hooks(on_event=ui.notice, on_member=on_member, on_life=on_life)
    async with trio.open_nursery() as nursery:
        peer = await nursery.start(functools.partial(run_peer, settings, hooks=hooks))
        printer = _Printer(peer.host, as_json)
        if settings.model_dir is None and not manifest.bootstrap and not settings.mdns:
            ui.notice("no bootstrap addresses and mDNS off: waiting for peers to dial us")
        if api is not None:
            from swarm.api.backend import NodeBackend
            from swarm.api.server import serve_api

            url = await nursery.start(functools.partial(serve_api, NodeBackend(peer), api, token=api_token))
            ui.notice(f"OpenAI-compatible endpoint on {url}/v1 (any peer forwards to the coordinator)")
            ui.notice(f"web console on {url}/ and chat on {url}/chat"
                      + (" (the page asks for the API token)" if api_token else ""))  # fmt: skip
        nursery.start_soon(_signals, nursery.cancel_scope, peer)
        if exit_after is not None:
            nursery.cancel_scope.deadline = trio.current_time() + exit_after
        while True:
            await trio.sleep(1.0)
            printer.refresh(peer.service)
    if settings.model_dir is None:
        ui.notice(f"left swarm {manifest.swarm_name!r} ({len(peer.service.members())} peers connected at exit)")
    else:
        ui.notice(f"left swarm {manifest.swarm_name!r}")


def node_settings_of(manifest: Manifest, seed: bytes, listen: list[str], memory: int, model_dir: Path | None, *,
                     dtype: str, device: str, threads: int, mdns: bool, relay: bool,
                     draft: str = "ngram", sessions: int = NodeSettings.sessions,
                     compile: bool = False, compile_span: int = NodeSettings.compile_span) -> NodeSettings:  # fmt: skip
    """The node's settings, built once from the invite, the config file and the flags."""
    fastpath_host = ""
    torch_dtype = None
    if model_dir is not None:
        from swarm.model.dtypes import resolve_dtype
        from swarm.net.host import dialable_addrs
        from swarm.net.mdns import interface_table
        from swarm.node.settings import model_type

        dialable = dialable_addrs(list(listen), interface_table())
        fastpath_host = next((a.split("/")[2] for a in dialable if a.startswith("/ip4/") and not a.startswith("/ip4/127.")),
                             "127.0.0.1")  # fmt: skip
        torch_dtype = resolve_dtype(dtype, device, model_type(model_dir))  # auto: never fp16 for Gemma
    return NodeSettings(
        seed=seed, swarm_id=manifest.swarm_id, secret=manifest.secret.value, model_dir=model_dir,
        listen=tuple(listen), bootstrap=tuple(manifest.bootstrap), memory_bytes=memory, dtype=torch_dtype,
        device=device, quant=manifest.quant, context_tokens=manifest.context_tokens,
        kv_cache=manifest.kv_cache, threads=threads or max(1, (os.cpu_count() or 2)),
        revoked=frozenset(manifest.revoked), fastpath_host=fastpath_host, relay=relay, mdns=mdns, draft=draft,
        sessions=sessions, compile=compile, compile_span=compile_span,
    )  # fmt: skip


class _Left:
    """Set once a signal asked us to leave: the process then exits at once (see _exit_now)."""

    by_signal = False


async def _signals(scope: trio.CancelScope, peer: Any) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            ui.notice("leaving the swarm...")
            _Left.by_signal = True
            await peer.leave()  # the swarm re-plans without us first (bounded: LEAVE_TIMEOUT_S)
            scope.cancel()
            return


def _exit_now(code: int) -> None:
    """After a Ctrl-C leave: flush and end the process without the interpreter's teardown, which
    takes 3-6 s with torch and libp2p loaded on a busy machine (measured here) and would make
    the leave's stated bound a lie. Everything that matters is closed by then: the host's
    connections, the node's tasks, stdout and stderr."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    logging.shutdown()
    os._exit(code)


async def _diagnose(manifest: Manifest, seed: bytes, listen: list[str], as_json: bool, relay: bool) -> None:
    """What join does, reported: admission with each bootstrap, dial-back, a relay reservation
    and DCUtR readiness (swarm.net.nat.diagnose). Network failures are facts in the report."""
    from swarm.net.mdns import interface_table
    from swarm.net.nat import diagnose
    from swarm.net.relay import open_relay

    local_ips = [ip for v in interface_table().values() for ip in v]
    async with (
        open_host(seed, listen, secret=manifest.secret.value, swarm_id=manifest.swarm_id,
                  revoked=frozenset(manifest.revoked)) as host,
        contextlib.AsyncExitStack() as stack,
    ):  # fmt: skip
        node = await stack.enter_async_context(open_relay(host.libp2p, admit=host.dial)) if relay else None
        host.attach_relay(node)
        report = await diagnose(host.libp2p, bootstrap_addrs=list(manifest.bootstrap), relay=node,
                                local_ips=local_ips, admit=host.dial)  # fmt: skip
        host.attach_relay(None)
    if as_json:
        ui.print_json(report.to_dict())
    else:
        for line in report.lines():
            sys.stdout.write(line + "\n")


def join(
    manifest_path: Path | None = typer.Option(None, "--manifest", help="Invite file (default: <config dir>/invite.json)."),
    model: Path | None = typer.Option(None, "--model", help="Local copy of the swarm's model, checked against the invite."),
    listen: list[str] | None = typer.Option(None, "--listen", help="Multiaddr to listen on (repeatable). " + flag_help("node.listen")),
    memory: str | None = typer.Option(None, "--memory", help="E.g. 24G. " + flag_help("node.memory")),
    diagnose: bool = typer.Option(False, "--diagnose", help="Check how this node is reachable, then exit."),
    mdns: bool = typer.Option(True, "--mdns/--no-mdns", help="Announce and discover on the LAN."),
    relay: bool = typer.Option(True, "--relay/--no-relay", help="Use bootstrap nodes as relays (and hole punch)."),
    key: Path | None = typer.Option(None, "--key", help="Identity key file (default: <config dir>/identity.key)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line on stdout."),
    exit_after: float | None = typer.Option(None, "--exit-after", help="Leave after this many seconds."),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="Hold layers (or coordinate) for the swarm; --no-serve only shows peers."),
    api: str | None = typer.Option(None, "--api", help="Serve the OpenAI-compatible endpoint here, e.g. 127.0.0.1:8000."),
    api_token_file: Path | None = typer.Option(None, "--api-token-file", help="File holding the API's bearer token (required off localhost; or SHARD_SWARM_API_TOKEN, or api.token in the config)."),
    api_token_argv: str | None = typer.Option(None, "--api-token", hidden=True, help="Refused: argv is visible to every user."),
    dtype: str | None = typer.Option(None, "--dtype", help=flag_help("node.dtype")),
    device: str | None = typer.Option(None, "--device", help="auto (CUDA, then MPS, else CPU), cpu, cuda, cuda:N or mps (default: node.device, else auto)."),
    threads: int | None = typer.Option(None, "--threads", help=flag_help("node.threads")),
    sessions: int | None = typer.Option(None, "--sessions", help=flag_help("node.sessions")),
    peers: list[str] = typer.Option([], "--peer", help="Also dial this peer first, like a bootstrap (a multiaddr ending in /p2p/ID; repeatable; see `shard-swarm id`)."),
    draft: str = typer.Option("ngram", "--draft", help=JOIN_HELP),
    model_manifest: Path | None = typer.Option(None, "--model-manifest", help="The model manifest the invite names by hash (default: the cache, else the invite's manifest_url)."),
    disk: str | None = typer.Option(None, "--disk", help="Bound the cache of fetched model slices, e.g. 200G (default: no bound)."),
    compile_: bool = typer.Option(False, "--compile/--no-compile", help="Run this node's one-token decode steps and drafted verify chunks (up to 8 rows) as compiled graphs (torch.compile on a CPU; hand-written Llama-family layers, unquantized KV cache), compiled before it serves (cached on disk after the first start); a stage that cannot compile serves eagerly and says why. A per-node choice: fp32 tokens equal eager's."),
    compile_span: int | None = typer.Option(None, "--compile-span", help=compile_span_help(NodeSettings.compile_span)),
) -> None:
    """Join a swarm: connect, be admitted, and show peers as they appear."""
    api_token = _api_token(api_token_file, api_token_argv)
    span = NodeSettings.compile_span if compile_span is None else check_compile_span(compile_span, compile=compile_)
    cfg = node_settings({"node.listen": listen or None, "node.memory": memory, "node.dtype": dtype, "node.threads": threads,
                         "node.sessions": sessions})  # fmt: skip
    listen, memory = list(cfg.get("node.listen")), str(cfg.get("node.memory"))
    dtype, threads, sessions = str(cfg.get("node.dtype")), int(cfg.get("node.threads")), int(cfg.get("node.sessions"))
    if logging.getLogger("swarm").getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # its dial-retry noise, unless -v
    path = manifest_path or (config_dir() / "invite.json")
    if manifest_path is None and not path.exists():
        raise UsageError(f"no invite given and none at {path}: pass --manifest FILE (create one with `shard-swarm invite create`)")
    manifest = read_manifest(path)
    if manifest.role != "member":
        raise UsageError(f"{path} is a client invite: it runs `generate` and `status`, it cannot join (ask for a member invite)")
    if check_pin(manifest):
        ui.notice(f"pinned issuer {manifest.issuer_peer_id} for swarm {manifest.swarm_name!r} (trust on first use)")
    dev = _serving_device(device) if serve and not diagnose else None  # a missing device: exit 2 now
    if peers:
        from swarm.net.paths import parse_peer_addr

        for p in peers:
            parse_peer_addr(p, what="--peer")
        manifest = dataclasses.replace(manifest, bootstrap=tuple(dict.fromkeys([*peers, *manifest.bootstrap])))
    by_manifest = manifest.model is not None and manifest.model.manifest_sha256 is not None
    if model is not None:
        if manifest.model is None:
            raise UsageError(f"--model given but the invite {path} names no model")
        if not by_manifest:  # an invite that pins whole files: hash them all (a model manifest: per tensor, as loaded)
            from swarm.manifest.modelcheck import check_model

            with ui.progress(f"checking {model.name}") as report:
                check_model(manifest.model, model, report)
    draft = check_join_draft(draft, manifest) if serve and not diagnose else draft
    identity = load_identity(key) if key is not None and key.exists() else load_or_create_identity(key)
    if diagnose:
        ui.notice(f"checking how {identity.peer_id} is reachable for swarm {manifest.swarm_name!r}...")
        trio.run(_diagnose, manifest, identity.seed, listen, as_json, relay)
        return
    mem = parse_size(memory) if dev is None else offered_memory(memory, dev)
    on = f" on {dev}" if dev is not None else ""
    ui.notice(f"joining swarm {manifest.swarm_name!r} as {identity.peer_id}, offering {ui.size(mem)}{on}")
    model_dir: Path | None = None
    fetch_dir: Path | None = None
    disk_bytes = parse_size(disk) if disk is not None else 0
    if serve and by_manifest and manifest.model is not None:
        # slices fetched (or a local copy's tensors verified) per plan, only what is loaded
        from swarm.cli.model import headers_from_members, prepare_fetch

        members = headers_from_members(identity.seed, manifest.secret.value, manifest.swarm_id, list(manifest.bootstrap),
                                       frozenset(manifest.revoked))  # fmt: skip
        model_dir, fetch_dir = prepare_fetch(manifest.model, disk_bytes or None, local=model, manifest_file=model_manifest,
                                             from_members=members)  # fmt: skip
    elif serve:
        from swarm.model.packaged import resolve_model

        with ui.progress("preparing the model (first run only)") as report:
            model_dir = resolve_model(model, progress=report)  # a path, a packaged name, or the bundled one
    if api is not None:
        if model_dir is None:
            raise UsageError("--api needs a serving node (drop --no-serve)")
        from swarm.api.server import check_bind

        check_bind(api, api_token)
    settings = node_settings_of(manifest, identity.seed, listen, mem, model_dir, dtype=dtype, device=dev or "cpu",
                                threads=threads, mdns=mdns, relay=relay, draft=draft, sessions=sessions,
                                compile=compile_, compile_span=span)  # fmt: skip
    if fetch_dir is not None and manifest.model is not None:
        settings = dataclasses.replace(settings, fetch_dir=fetch_dir, origin=manifest.model.origin, disk_bytes=disk_bytes)
    trio.run(lambda: _run_peer(settings, manifest, as_json=as_json, exit_after=exit_after, api=api, api_token=api_token))
    if _Left.by_signal:
        _exit_now(0)


def _api_token(path: Path | None, argv_value: str | None) -> str | None:
    """The API token from a file, SHARD_SWARM_API_TOKEN or api.token in the config file: never
    from the command line, which every user of the machine can read in /proc/*/cmdline."""
    if argv_value is not None:
        raise UsageError("--api-token on the command line is visible to every user of this machine (/proc/*/cmdline): "
                         "put the token in a file (--api-token-file, mode 0600), SHARD_SWARM_API_TOKEN or api.token")
    if path is not None:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--api-token-file {path}: cannot read it ({exc})") from None
        if not token:
            raise UsageError(f"--api-token-file {path} is empty")
        return token
    env = os.environ.get("SHARD_SWARM_API_TOKEN", "").strip()
    if env:
        return env
    configured = str(node_settings({}).get("api.token") or "")
    return configured or None


def register(app: typer.Typer) -> None:
    app.command("join")(join)


def main(argv: list[str] | None = None) -> int:
    """``python -m swarm.cli.join [OPTIONS]``: the join command alone, without importing the
    other commands (``shard-swarm`` loads torch for ``run``; a node that only joins needs none)."""

    ui.configure(verbose=bool(os.environ.get("SHARD_SWARM_VERBOSE")))
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(join)
    from swarm.cli.main import run_guarded

    return run_guarded(lambda: app(args=argv, standalone_mode=False))


if __name__ == "__main__":
    sys.exit(main())
