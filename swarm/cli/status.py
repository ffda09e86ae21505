"""``shard-swarm status``: the ring as the coordinator sees it, live on a TTY, text or JSON otherwise.

The command joins as a client (the invite's secret; it never advertises), asks one peer for the
coordinator's status (``--peer``, else the invite's bootstrap addresses in turn) and turns it into
a *view*: the coordinator, the stages in ring order with their blocks, device, memory used and
offered, ms per layer, RTT to the next hop, heartbeat age and how each peer is reached, plus the
swarm's recent tok/s and tokens accepted per traversal. ``build_view`` is a pure function of the
status dict, so the JSON (``--json``), the plain text (not a TTY) and the live table (a TTY,
refreshed every ``--interval`` s until Ctrl-C; ``--once`` for one frame) all show the same thing.

Fields the node does not report (yet) are shown as "-" (None in JSON), never guessed. The status
dict is swarm/node/generation/service.py ``status()``; optional keys read here: ``peer_info`` (peer ->
``device``, ``memory_used_bytes``, ``heartbeat_age_s``, ``path``) and ``recent``
(``tokens_per_s``, ``accepted_per_traversal``).

``--web`` prints the web console's URL instead (swarm/api/console.py): the node's API address
from ``--api`` or the config file's ``api.address``, and says on stderr whether it answers.

Exit codes: 0 shown; 2 bad flags; 4 invite refused; 7 no peer answered.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import trio
import typer

from swarm import client
from swarm.cli import ui
from swarm.errors import PeerError, SwarmError, UsageError
from swarm.manifest.identity import config_dir
from swarm.manifest.manifest import read_manifest
from swarm.node.generation.ringview import build_view


def _num(v: Any, fmt: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{unit}"


short = ui.short


COLUMNS = ["#", "peer", "role", "layers", "device", "memory peak/offered", "ms/layer", "rtt→next", "heartbeat",
           "reached"]  # fmt: skip


def table_rows(view: dict[str, Any]) -> list[list[str]]:
    out = []
    for i, r in enumerate([*view["ring"], *view["others"]]):
        blk = r["block"]
        mem = f"{_num(r['memory_used_gb'], '.2f')}/{_num(r['memory_offered_gb'], '.2f')} GB"
        out.append([str(i) if i < len(view["ring"]) else "", short(r["peer"]), r["role"],
                    f"[{blk[0]}, {blk[1]})" if blk else "-", r["device"] or "-", mem, _num(r["ms_per_layer"], ".2f"),
                    _num(r["rtt_next_ms"], ".1f", " ms"), _num(r["heartbeat_age_s"], ".1f", " s"),
                    r["path"] or "-"])  # fmt: skip
    return out


def headline(view: dict[str, Any]) -> list[str]:
    state = "serving" if view["serving"] else "not serving"
    lines = [f"swarm epoch {_num(view['epoch'], 'd')} · {state} · coordinator {short(view['coordinator'])} · "
             f"leader {short(view['leader'])} · asked {short(view['asked'])}"]  # fmt: skip
    lines.append(f"ring: {_num(view['ring_rtt_ms'], '.1f', ' ms')} of hops per traversal · recent "
                 f"{_num(view['tokens_per_s'], '.1f', ' tok/s')} · "
                 f"{_num(view['accepted_per_traversal'], '.2f')} tokens per traversal · {view['replans']} replans")  # fmt: skip
    mem = view.get("memory") or {}
    if mem.get("predicted_peak_gb") is not None or mem.get("measured_peak_gb") is not None:
        lines.append(f"memory of {short(view['asked'])}: predicted peak {_num(mem.get('predicted_peak_gb'), '.2f', ' GB')}"
                     f" · measured peak {_num(mem.get('measured_peak_gb'), '.2f', ' GB')}"
                     f" (now {_num(mem.get('measured_rss_gb'), '.2f', ' GB')})"
                     f" · offered {_num(mem.get('offered_gb'), '.2f', ' GB')}")  # fmt: skip
    if view.get("hops"):
        lines.append("hops: " + " · ".join(f"{short(h.get('from'))} → {short(h.get('to'))} {h.get('path', '?')}"
                                           for h in view["hops"]))  # fmt: skip
    return lines


def format_text(view: dict[str, Any]) -> str:
    """Plain text (no colour, no box drawing): for pipes, logs and non-TTY terminals."""
    rows = [COLUMNS, *table_rows(view)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([*headline(view), *body]) + "\n"


async def fetch_status(host: Any, peer: str) -> dict[str, Any]:
    """The coordinator's status (relayed by ``peer``), or ``peer``'s own when no ring serves."""
    try:
        return await client.status(host, peer, coordinator=True)
    except PeerError:
        return await client.status(host, peer)


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def _run(addrs: list[str], secret: bytes, swarm_id: str, *, as_json: bool, live: bool, interval: float,
               timeout: float, role: str = "member", member_key: bytes = b"") -> None:  # fmt: skip
    last: SwarmError | None = None
    for addr in addrs:
        try:
            async with client.open_client(addr, secret=secret, swarm_id=swarm_id, timeout=timeout, role=role,
                                          member_key=member_key) as (host, peer):  # fmt: skip
                view = build_view(await fetch_status(host, peer))
                if as_json:
                    ui.print_json(view)
                elif not live:
                    sys.stdout.write(format_text(view))
                    sys.stdout.flush()
                else:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
                        with ui.live_status() as show:
                            while True:
                                show(headline(view), COLUMNS, table_rows(view))
                                await trio.sleep(interval)
                                view = build_view(await fetch_status(host, peer))
                return
        except PeerError as exc:
            last = exc
            if len(addrs) > 1:
                ui.notice(f"{addr}: {exc}")
    if len(addrs) == 1 and last is not None:
        raise PeerError(f"the swarm did not answer: {last}")
    raise PeerError(f"no peer answered ({len(addrs)} tried){': ' + str(last) if last else ''}")


def status(
    manifest_path: Path | None = typer.Option(None, "--manifest", help="Invite file (default: <config dir>/invite.json)."),
    peer: str | None = typer.Option(None, "--peer", help="Ask this peer (a multiaddr ending in /p2p/ID)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
    once: bool = typer.Option(False, "--once", help="On a TTY, print one frame instead of a live view."),
    interval: float = typer.Option(1.0, "--interval", min=0.2, help="Seconds between refreshes of the live view."),
    timeout: float = typer.Option(15.0, "--timeout", min=1.0, help="Seconds to reach a peer."),
    web: bool = typer.Option(False, "--web", help="Print the web console's URL (this machine's node's API: --api or api.address in the config file) and exit."),
    api: str | None = typer.Option(None, "--api", help="With --web: the address the node's API listens on (default: api.address)."),
) -> None:
    """Show the ring: coordinator, stages, blocks, memory, RTTs, recent speed."""
    if web:
        show_web_url(api)
        return
    path = manifest_path or (config_dir() / "invite.json")
    if manifest_path is None and not path.exists():
        raise UsageError(f"no invite given and none at {path}: pass --manifest FILE (the swarm's invite)")
    manifest = read_manifest(path)
    if peer is not None and "/p2p/" not in peer:
        raise UsageError(f"--peer {peer!r}: expected a multiaddr ending in /p2p/<peer ID>")
    addrs = [peer] if peer else list(manifest.bootstrap)
    if not addrs:
        raise UsageError(f"the invite {path} lists no bootstrap address: pass --peer MULTIADDR")
    live = not as_json and not once and ui.stdout_is_tty()
    secret, role, mkey = client.client_credential(manifest.secret.value, manifest.role, manifest.member_key)
    trio.run(lambda: _run(addrs, secret, manifest.swarm_id, as_json=as_json, live=live,
                          interval=interval, timeout=timeout, role=role, member_key=mkey))  # fmt: skip


def web_url(address: str) -> str:
    """The console's URL for an API bound at ``address`` (a wildcard bind is reached on loopback)."""
    from swarm.api.server import parse_bind

    host, port = parse_bind(address)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def show_web_url(api: str | None) -> None:
    """``status --web``: the URL on stdout; on stderr, whether a console answers there now."""
    import httpx

    from swarm.cli.settings import load_config

    address = api or str(load_config().get("api.address") or "")
    if not address:
        raise UsageError("no API address: this machine's node serves the console only with `join --api HOST:PORT` "
                         "(or api.address in the config file); pass --api HOST:PORT")  # fmt: skip
    url = web_url(address)
    sys.stdout.write(url + "\n")
    sys.stdout.flush()
    try:
        up = httpx.get(url, timeout=3.0).status_code == 200
    except httpx.HTTPError:
        up = False
    ui.notice("the console answers there (it asks for the API token if the node has one)" if up else
              f"nothing answers at {url} yet: is `shard-swarm join --api {address}` running?")  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("status")(status)
