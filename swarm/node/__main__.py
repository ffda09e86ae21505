"""``python -m swarm.node SETTINGS.json``: run one node process (used by ``shard-swarm demo``).

The settings file holds NodeSettings fields and names the invite manifest (swarm ID, secret,
bootstrap addresses; verified on load) and the identity seed file; secrets are read from those
0600 files, never from the command line, where ``ps`` would show them.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path

import trio

from swarm.manifest.manifest import read_manifest
from swarm.model.devices import device_label, resolve_device
from swarm.model.dtypes import resolve_dtype
from swarm.node.runtime import Node, NodeSettings


def settings_from_file(path: Path) -> NodeSettings:
    cfg = json.loads(path.read_text())
    manifest = read_manifest(Path(cfg["manifest"]))  # verified: signature, expiry, fields
    device = resolve_device(cfg.get("device", "auto"))
    return NodeSettings(
        seed=bytes.fromhex(Path(cfg["seed_file"]).read_text().strip()),
        swarm_id=manifest.swarm_id,
        secret=manifest.secret.value,
        revoked=frozenset(manifest.revoked),
        quant=manifest.quant,
        model_dir=Path(cfg["model_dir"]),
        listen=tuple(cfg.get("listen", ["/ip4/127.0.0.1/tcp/0"])),
        announce=tuple(cfg.get("announce", [])),
        bootstrap=tuple(manifest.bootstrap),
        memory_bytes=int(cfg.get("memory_bytes", 0)),
        dtype=resolve_dtype(cfg.get("dtype", "auto"), device),
        device=device_label(device),
        threads=int(cfg.get("threads", 1)),
        coordinator_ok=bool(cfg.get("coordinator_ok", True)),
        expect_peers=int(cfg.get("expect_peers", 0)),
        context_tokens=int(cfg.get("context_tokens", 2048)),
        draft=cfg.get("draft", "ngram"),
        chunk_timeout=float(cfg.get("chunk_timeout", 30.0)),
        fastpath=bool(cfg.get("fastpath", True)),
        fastpath_port=int(cfg.get("fastpath_port", 0)),
        fastpath_advertise=tuple(cfg.get("fastpath_advertise", [])),
        compute_delay_s=float(cfg.get("compute_delay_s", 0.0)),
        sessions=int(cfg.get("sessions", 8)),
    )


async def _main(settings: NodeSettings) -> None:
    def event(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2) as signals:
            node = await nursery.start(Node(settings, on_event=event).run)
            async for signum in signals:
                if signum == signal.SIGUSR1:  # fault injection for chaos tests
                    node.start_corrupting()
                    continue
                if signum == signal.SIGUSR2:  # fault injection: a hop that silently stops delivering
                    node.start_swallowing()
                    continue
                event("leaving")
                await node.leave()  # the swarm re-plans without us first (bounded)
                nursery.cancel_scope.cancel()
                return


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m swarm.node SETTINGS.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.WARNING)
    trio.run(_main, settings_from_file(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
