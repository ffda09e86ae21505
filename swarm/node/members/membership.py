"""Membership's view: who is in the swarm, what each peer offers, and how far apart they are.

Every peer publishes one signed :class:`~swarm.proto.messages.Advert` about itself: peer ID,
addresses, device kind and name, memory offered for layers, measured time per layer and its
measured RTTs to the others. Each change bumps the advert's sequence number and re-signs it.
The first sequence number is the wall clock in milliseconds, so a restarted node's adverts are
newer than anything its previous run published even though it kept no state.

:class:`Membership` is the *view*: the latest valid advert per peer
(:class:`~swarm.proto.signed.AdvertBook` checks the swarm ID, that the key matches the peer ID,
and the signature; a stale or repeated sequence number is ignored, a forged advert refused). The
view exports the planner's peers-file format. Running it on a host (links, heartbeats, gossip,
dialing) is ``gossip.py``.

The book holds at most ``max_peers`` (256) others. Made-up identities never connect, so they
expire and give way to anyone; when real connected identities fill it, a connected newcomer
evicts the one heard from least recently, never a peer the node pins (:meth:`Membership.guard_book`:
the leader and the members of the plan it serves, peer.py); we are never in our own book.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from swarm.errors import UsageError
from swarm.planner.peersfile import dump_peers_file, held_ranges
from swarm.planner.spec import Peer
from swarm.proto.limits import DEFAULT_LIMITS
from swarm.proto.messages import MAX_HELD_RANGES, Advert
from swarm.proto.signed import AdvertBook, sign_advert
from swarm.proto.signing import Signer, peer_id_of

# ---------------------------------------------------------------------------- device detection


def detect_device() -> tuple[str, str]:
    """(kind, name) of the best accelerator, found cheaply (no torch import, no subprocess).

    ``cuda`` when an NVIDIA driver lists a GPU (or an already-imported torch sees one), ``mps`` on
    Apple silicon, otherwise ``cpu`` with the CPU model name.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_available():
                return "cuda", str(torch.cuda.get_device_name(0))[:128]
    with contextlib.suppress(OSError):
        for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    return "cuda", line.split(":", 1)[1].strip()[:128]
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mps", "Apple silicon"
    name = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return "cpu", (name or platform.processor() or platform.machine() or "cpu")[:128]


def layer_ranges(layers: Iterable[int]) -> dict[str, int]:
    """Layers as an advert's ranges {"start": end}, the first MAX_HELD_RANGES of them."""
    return dict(list(held_ranges(layers).items())[:MAX_HELD_RANGES])


# ---------------------------------------------------------------------------- the view


class Membership:
    """Our own signed advert and the latest valid advert of every other peer."""

    def __init__(
        self,
        signer: Signer,
        swarm_id: str,
        *,
        addrs: Sequence[str] = (),
        device: tuple[str, str] | None = None,
        memory_bytes: int = 0,
        ms_per_layer: float = 0.0,
        revoked: frozenset[str] = frozenset(),
        first_seq: int | None = None,
        draft: tuple[str, int, float] | None = None,  # (name, bytes, ms per token) it runs as coordinator
        sessions: int | None = None,  # the sessions' KV its stage reserves (None: absent from the advert)
        dtype_bytes: int | None = None,  # the width of the values it serves in (None: absent from the advert)
    ) -> None:
        if memory_bytes < 0:
            raise UsageError(f"memory offered must be >= 0 bytes, got {memory_bytes}")
        self.signer = signer
        self.swarm_id = swarm_id
        self.peer_id = peer_id_of(signer.public_key)
        self._book = AdvertBook(swarm_id, revoked)
        kind, name = device if device is not None else detect_device()
        seq = int(time.time() * 1000) if first_seq is None else first_seq
        self._local = sign_advert(
            Advert(
                peer_id=self.peer_id, public_key=signer.public_key, swarm_id=swarm_id, seq=seq,
                addrs=tuple(addrs)[: DEFAULT_LIMITS.max_addresses], device_kind=kind, device_name=name,
                memory_bytes=int(memory_bytes), layer_us=_us(ms_per_layer / 1000.0), **_draft_fields(draft),
                sessions=sessions, dtype_bytes=dtype_bytes,
            ),
            signer,
        )  # fmt: skip

    @property
    def local(self) -> Advert:
        return self._local

    def update_local(
        self,
        *,
        addrs: Sequence[str] | None = None,
        memory_bytes: int | None = None,
        ms_per_layer: float | None = None,
        rtt_ms: dict[str, float] | None = None,
        held: tuple[Sequence[int], bool] | None = None,
        disk: int | None = None,
    ) -> bool:
        """Change our advert; re-signs with the next sequence number. False if nothing changed.
        ``held``: the layers this node holds verified and whether it holds the head (it serves
        them to members on /shard-swarm/tensors/1). ``disk``: bytes of disk left for model bytes it
        does not hold yet (-1: unbounded, the field then absent)."""
        changes: dict[str, object] = {}
        if disk is not None:
            changes["disk"] = None if disk < 0 else int(disk)
        if held is not None:
            changes["held"] = layer_ranges(held[0]) or None
            changes["held_head"] = True if held[1] else None
        if addrs is not None:
            changes["addrs"] = tuple(addrs)[: DEFAULT_LIMITS.max_addresses]
        if memory_bytes is not None:
            if memory_bytes < 0:
                raise UsageError(f"memory offered must be >= 0 bytes, got {memory_bytes}")
            changes["memory_bytes"] = int(memory_bytes)
        if ms_per_layer is not None:
            changes["layer_us"] = _us(ms_per_layer / 1000.0)
        if rtt_ms is not None:
            changes["rtt_us"] = {p: _us(v / 1000.0) for p, v in sorted(rtt_ms.items()) if p != self.peer_id}
        new = dataclasses.replace(self._local, **changes)  # type: ignore[arg-type]
        if new == self._local:
            return False
        self._local = sign_advert(dataclasses.replace(new, seq=self._local.seq + 1), self.signer)
        return True

    def offer(self, advert: Advert, *, now: float = 0.0, connected: bool = True) -> bool:
        """True if ``advert`` is news (kept); False if stale or our own; ProtocolError if forged.
        An advert of a peer not ``connected`` to us expires unless it connects (AdvertBook)."""
        if advert.peer_id == self.peer_id:
            return False
        return self._book.offer(advert, now=now, connected=connected)

    def guard_book(
        self, *, pinned: Callable[[], Collection[str]] | None = None,
        last_heard: Callable[[str], float | None] | None = None,
    ) -> None:  # fmt: skip
        """How a full advert book makes room for a connected newcomer (AdvertBook): it evicts
        the connected peer heard from least recently (``last_heard``: the failure detector's),
        never one of ``pinned`` (asked only when the book is full)."""
        if pinned is not None:
            self._book.pinned = pinned
        if last_heard is not None:
            self._book.last_heard = last_heard

    def confirm(self, peer: str) -> None:
        self._book.confirm(peer)

    def expire(self, now: float) -> list[str]:
        return self._book.expire(now)

    def unconfirmed(self) -> list[str]:
        """Peers whose advert we hold but who never connected to us."""
        return self._book.unconfirmed()

    def forget(self, peer: str) -> None:
        self._book.forget(peer)

    def get(self, peer: str) -> Advert | None:
        return self._local if peer == self.peer_id else self._book.get(peer)

    def view(self) -> dict[str, Advert]:
        """Every member's latest advert, ourselves included."""
        out = self._book.peers()
        out[self.peer_id] = self._local
        return dict(sorted(out.items()))

    def peers_file(self, *, members: Collection[str] | None = None, others: int = 0) -> dict[str, object]:
        """The planner's peers-file (``{"peers": [...], "rtt_ms": {...}}``) of the current view.
        RTTs are as each peer measured them, limited to peers in the view.

        ``members`` (for a status reply, which must stay small however many adverts a member made
        up): list those peers with their RTTs among them, then at most ``others`` more of the
        view without RTTs."""
        view = self.view()
        if members is not None:
            keep = [p for p in view if p in members]
            keep += [p for p in view if p not in members][:others]
            view = {p: view[p] for p in keep}
        rtt_peers = view if members is None else {p for p in view if p in members}
        peers = [
            Peer(p, a.memory_bytes, a.layer_us / 1000.0, True, tuple(a.addrs),
                 None if a.draft_us is None else a.draft_us / 1000.0, a.draft_bytes or 0,
                 frozenset(a.held_layers()), bool(a.held_head), a.disk, a.sessions, a.dtype_bytes)  # fmt: skip
            for p, a in view.items()
        ]
        rtt = {
            p: {q: us / 1000.0 for q, us in a.rtt_us.items() if q in rtt_peers and q != p}
            for p, a in view.items() if p in rtt_peers
        }  # fmt: skip
        return dump_peers_file(peers, {p: row for p, row in rtt.items() if row})


def _draft_fields(draft: tuple[str, int, float] | None) -> dict[str, Any]:
    if draft is None:
        return {}
    name, nbytes, ms = draft
    return {"draft_name": name[:128], "draft_bytes": int(nbytes), "draft_us": _us(ms / 1000.0)}


def _us(seconds: float) -> int:
    return max(0, min(10**9, int(round(seconds * 1_000_000))))
