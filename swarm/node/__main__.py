"""``python -m swarm.node SETTINGS.json``: run one node process (the demo, tests, benchmarks).

The settings file holds NodeSettings fields by name and names the invite manifest (swarm ID,
secret, bootstrap addresses; verified on load) and the identity seed file; secrets are read from
those 0600 files, never from the command line, where ``ps`` would show them (settings.py). The
node is built by the same composition root as ``shard-swarm join`` (peer.py). SIGTERM or SIGINT:
leave (bounded), then exit; SIGUSR1, SIGUSR2: fault injection for chaos tests (NaN activations;
a stage that silently drops what it reads in this epoch).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import trio

from swarm.node.notices import Hooks
from swarm.node.peer import open_peer
from swarm.node.settings import NodeSettings, settings_from_file


async def _main(settings: NodeSettings) -> None:
    def event(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2) as signals:
        async with open_peer(settings, hooks=Hooks(on_event=event)) as peer:
            async for signum in signals:
                if signum == signal.SIGUSR1:  # fault injection for chaos tests
                    peer.start_corrupting()
                    continue
                if signum == signal.SIGUSR2:  # fault injection: a hop that silently stops delivering
                    peer.start_swallowing()
                    continue
                event("leaving")
                await peer.leave()  # the swarm re-plans without us first (bounded)
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
