"""An epoch's hops: opening the ones that leave this node, taking the ones that enter it, and
running the stage worker and the coordinator's result reader on them.

Theory of operation
-------------------
On ``connect`` a peer opens every hop that leaves it, in traversal order: hop 0 is the
coordinator's send link, hop i + 1 is ring[i]'s downstream, the last hop enters the coordinator.
A hop whose two ends are this peer is an in-process LocalLink; any other is a fast-path channel
(direct sealed socket, or the libp2p stream when none can be opened) whose first frame is a
``hop`` hello naming the epoch and hop index, checked against the plan by the receiver: only the
hop's upstream peer may open it. On ``serve`` the coordinator waits for its result link and
starts taking generations. ``connect`` and ``serve`` run once per epoch: a repeat is a no-op,
never a second worker nor a replaced link.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from swarm.errors import PeerTimeout, ProtocolError, SwarmError
from swarm.node.compute.runtime import Models
from swarm.node.hosting import Host
from swarm.node.members.probe import echo_probe, probe_once
from swarm.node.notices import Notices
from swarm.node.plan.epochs import Epoch, Epochs, hops
from swarm.node.ring.capacity import stage_capacity
from swarm.node.ring.fastlink import FrameLink
from swarm.node.ring.links import Link, LocalLink
from swarm.node.ring.stage_worker import StageWorker, session_idle_limit
from swarm.proto import control as ctl
from swarm.proto.limits import PROTO_ACT
from swarm.proto.tensors import RangeRequest

log = logging.getLogger("swarm.node")

LINK_TIMEOUT_S = 20.0
PUNCH_SETTLE_S = 8.0  # of the connect phase's LINK_TIMEOUT_S, spent at most on letting a hole punch finish
HELLO_TIMEOUT_S = 20.0


class Wiring:
    """The hops of the current epoch at this node. ``report_fault(peer, why, epoch)`` tells the
    leader about bad activations from our upstream; ``offered()`` is the memory we offer."""

    def __init__(
        self,
        peer_id: str,
        host: Host,
        fastpath: Any,
        epochs: Epochs,
        models: Models,
        notices: Notices,
        nursery: trio.Nursery,
        *,
        report_fault: Callable[[str, str, int], Any],
        offered: Callable[[], int],
        own_draft: Callable[[], int] = lambda: 0,
        tensors: Callable[[str, Any, RangeRequest], Awaitable[None]] | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.host = host
        self.fastpath = fastpath
        self.epochs = epochs
        self.models = models
        self.notices = notices
        self.nursery = nursery
        self.report_fault = report_fault
        self.offered = offered
        self.own_draft = own_draft  # our advertised draft model bytes (in our budget where we coordinate)
        self.hop_paths: dict[int, str] = {}  # hop index -> "direct" | "libp2p" | "local", for status
        self.corrupt = False  # fault injection (chaos tests, SIGUSR1 in python -m swarm.node)
        # a fast channel that opens with a RANGE_REQUEST: serve_tensors' handler (serving.py)
        self.tensors = tensors

    # -- connect: the hops that leave us, and our stage worker --------------------------------

    async def on_connect(self, peer: str, msg: ctl.Connect) -> ctl.Linked:
        """The signer's ``connect`` (dispatch.py checked the role): our hops' path labels."""
        labels = await self.connect(msg.epoch)
        return ctl.Linked({str(k): v for k, v in labels.items()})

    async def on_serve(self, peer: str, msg: ctl.Serve) -> ctl.Ack:
        """The signer's ``serve``: every hop's path label (by hop index) for status; we serve."""
        await self.serve(msg.epoch, {int(k): v for k, v in msg.hops.items() if k.isdigit()}, msg.compiled)
        return ctl.Ack()

    async def connect(self, epoch: int) -> dict[int, str]:
        """Open every hop that leaves this node; start our stage worker; their path labels."""
        ep = self.epochs.get(epoch)
        if "connect" in ep.phases:
            return self.labels(epoch)
        ep.phases.add("connect")
        # the whole of it within LINK_TIMEOUT_S, settling included: the leader waits
        # authority.CONNECT_REPLY_S for our answer and counts a member silent past it as a rogue
        try:
            with trio.fail_after(LINK_TIMEOUT_S):
                await self._open_hops(ep)
        except trio.TooSlowError:
            raise PeerTimeout(f"the hops of epoch {epoch} did not open within {LINK_TIMEOUT_S:.0f} s") from None
        if ep.stage is not None:
            self._start_worker(ep)
        return self.labels(epoch)

    async def _open_hops(self, ep: Epoch) -> None:
        epoch = ep.plan.epoch
        with trio.move_on_after(PUNCH_SETTLE_S):  # a hop opened on a relayed connection dies when DCUtR replaces it
            async with trio.open_nursery() as settling:
                for src, dst in hops(ep.plan):
                    if src == self.peer_id and dst != self.peer_id:
                        settling.start_soon(functools.partial(self.host.settle_path, dst, timeout=PUNCH_SETTLE_S))
        for i, (src, dst) in enumerate(hops(ep.plan)):
            if src != self.peer_id:
                continue
            if dst == self.peer_id:
                link = LocalLink(f"{self.peer_id[:8]} hop {i}")
                self.hop_paths[i] = "local"
                self._set_inbound(ep, i, link)
                self._set_outbound(ep, i, link)
            else:
                ready = trio.Event()
                failed: list[SwarmError] = []
                self.nursery.start_soon(self._hold_outbound, ep, i, dst, ready, failed)
                with trio.move_on_after(LINK_TIMEOUT_S):
                    await ready.wait()
                if failed:
                    raise failed[0]
                if not ready.is_set():
                    raise PeerTimeout(f"hop {i} to {dst} (epoch {epoch}) not open within {LINK_TIMEOUT_S:.0f} s")

    def _start_worker(self, ep: Epoch) -> None:
        assert ep.stage is not None
        s, epoch = self.epochs.settings, ep.plan.epoch
        idx = ep.plan.ring.index(self.peer_id)
        upstream = ep.plan.ring[idx - 1] if idx > 0 else ep.plan.coordinator
        nursery = self.nursery
        ep.worker = StageWorker(
            ep.stage, epoch=epoch, upstream=upstream, is_tail=idx == len(ep.plan.ring) - 1,
            max_len=self.models.context_tokens, compute=self.models.compute,
            on_bad_input=lambda peer, why: nursery.start_soon(self.report_fault, peer, why, epoch),
            compute_delay_s=s.compute_delay_s, max_sessions=self._stage_capacity(ep),
            corrupt_after=0 if self.corrupt else None, idle_s=session_idle_limit(s.chunk_timeout),
        )  # fmt: skip
        nursery.start_soon(self._run_worker, ep, idx)
        if ep.coordinator is None:
            self.notices.life("serving", epoch=epoch, role="stage")

    def _stage_capacity(self, ep: Epoch) -> int:
        """Sessions our block's KV caches fit in the memory we advertised (capacity.py)."""
        block = ep.plan.blocks[self.peer_id]
        coord = ep.plan.coordinator == self.peer_id
        spec = self.models.spec.at_width(self.models.dtype.itemsize)  # as the leader planned it (Peer.own)
        return stage_capacity(spec, self.offered(), block, coordinator=coord,
                              draft_bytes=self.own_draft() if coord else 0)  # fmt: skip

    def _set_outbound(self, ep: Epoch, hop: int, link: Link) -> None:
        """Hop 0 is the coordinator's send link; hop i + 1 is ring[i]'s downstream."""
        if hop == 0 and ep.coordinator is not None:
            ep.coordinator.attach(link)
        if ep.stage is not None and hop == ep.plan.ring.index(self.peer_id) + 1:
            ep.outbound = link
            ep.outbound_ready.set()

    def _set_inbound(self, ep: Epoch, hop: int, link: Link) -> None:
        ep.inbound[hop] = link
        ep.wait_inbound(hop).set()

    async def _hold_outbound(self, ep: Epoch, hop: int, dst: str, ready: trio.Event, failed: list[SwarmError]) -> None:
        hello = ctl.Hop(ep.plan.epoch, hop)
        try:
            if self.fastpath is not None:
                link = FrameLink(await self.fastpath.dial(dst, timeout=LINK_TIMEOUT_S))
                try:
                    await link.send_message(hello, timeout=LINK_TIMEOUT_S)
                    self.hop_paths[hop] = link.path
                    self._set_outbound(ep, hop, link)
                    ready.set()
                    await ep.done.wait()
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await link.close()
            else:
                async with self.host.open_stream(dst, PROTO_ACT, timeout=LINK_TIMEOUT_S) as fs:
                    await fs.send_message(hello)
                    self.hop_paths[hop] = "libp2p"
                    self._set_outbound(ep, hop, fs)
                    ready.set()
                    await ep.done.wait()
        except SwarmError as exc:
            log.warning("activation link to %s (epoch %d) ended: %s", dst, ep.plan.epoch, exc)
            if not ready.is_set():  # the connect phase waiting for it fails now, not at its deadline
                failed.append(exc)
                ready.set()
            self.epochs.end(f"link to {dst} failed: {exc}", only=ep)

    # -- the hops that enter us ------------------------------------------------------------

    async def accept_fast(self) -> None:
        """Serve the fast path's inbound channels (each is one hop into this node)."""
        assert self.fastpath is not None
        async for channel in self.fastpath.incoming:
            self.nursery.start_soon(self._serve_fast_act, FrameLink(channel))

    async def _serve_fast_act(self, link: FrameLink) -> None:
        try:
            first = await link.receive_message(timeout=HELLO_TIMEOUT_S)
            if isinstance(first, RangeRequest) and self.tensors is not None:
                await self.tensors(link.peer, link, first)  # model bytes for a member (compute/members.py)
            else:
                await self.serve_act(link.peer, link, first)
        except SwarmError as exc:
            log.warning("activation channel from %s: %s", link.peer, exc)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await link.close()

    async def serve_act(self, peer: str, fs: Link, hello: Any = None) -> None:
        """``/shard-swarm/act/1`` (or a fast-path channel, its first message ``hello`` read): one
        hop into this node, opened by its upstream peer with a ``hop`` hello and held until the
        epoch ends; or a probe of the path (a ``probe`` hello), echoed and closed."""
        if hello is None:
            hello = await fs.receive_message(timeout=HELLO_TIMEOUT_S)
        if isinstance(hello, ctl.Probe):
            await echo_probe(fs, peer, hello)  # a short channel that measures the path (probe.py)
            return
        if not isinstance(hello, ctl.Hop):
            raise ProtocolError(f"peer {peer}: activation stream must start with a hop hello")
        ep = self.epochs.get(hello.epoch)
        path = hops(ep.plan)
        if hello.hop >= len(path) or path[hello.hop] != (peer, self.peer_id):
            raise ProtocolError(f"peer {peer} does not send hop {hello.hop} to {self.peer_id} in epoch {hello.epoch}")
        self._set_inbound(ep, hello.hop, fs)
        await ep.done.wait()

    async def _run_worker(self, ep: Epoch, idx: int) -> None:
        worker = ep.worker
        assert worker is not None

        async def run() -> None:
            with trio.fail_after(LINK_TIMEOUT_S):
                await ep.wait_inbound(idx).wait()
                await ep.outbound_ready.wait()
            assert ep.outbound is not None
            await worker.serve(ep.inbound[idx], ep.outbound)

        try:
            await ep.until_done(run)
        except (SwarmError, trio.TooSlowError) as exc:
            self.epochs.end(f"stage worker: {exc}", only=ep)

    def labels(self, epoch: int) -> dict[int, str]:
        """How each hop leaving this node travels, for receipts and status: "local" (in this
        process), "direct" (a direct socket or connection), "hole-punched" (a direct connection
        DCUtR made from a relayed one) or "relayed via <relay>"."""
        ep = self.epochs.get(epoch)
        out: dict[int, str] = {}
        for i, (src, dst) in enumerate(hops(ep.plan)):
            if src != self.peer_id:
                continue
            kind = self.hop_paths.get(i, "")
            out[i] = kind if kind in ("local", "direct") else self.host.path_label(dst)
        return out

    # -- serve: the coordinator takes generations ------------------------------------------

    async def serve(self, epoch: int, hop_labels: dict[int, str], compiled: dict[str, dict[str, Any]] | None = None) -> None:
        ep = self.epochs.get(epoch)
        ep.hop_labels = dict(hop_labels)
        ep.compiled = {p: c for p, c in (compiled or {}).items() if p in ep.plan.blocks}
        if ep.coordinator is None:
            raise ProtocolError(f"{self.peer_id} is not the coordinator of epoch {epoch}")
        if "serve" in ep.phases:
            return
        ep.phases.add("serve")
        with trio.move_on_after(LINK_TIMEOUT_S):
            await ep.wait_inbound(len(ep.plan.ring)).wait()
        if not ep.wait_inbound(len(ep.plan.ring)).is_set():
            raise PeerTimeout(f"the result link of epoch {epoch} did not open within {LINK_TIMEOUT_S:.0f} s")
        self.nursery.start_soon(self._run_results, ep, ep.plan.ring[-1])
        self.epochs.mark_serving(ep)
        self.notices.event(f"serving epoch {epoch}: ring ready")
        self.notices.life("serving", epoch=epoch, role="coordinator")

    async def _run_results(self, ep: Epoch, tail: str) -> None:
        coord = ep.coordinator
        assert coord is not None
        try:
            await ep.until_done(lambda: coord.serve_results(ep.inbound[len(ep.plan.ring)], tail_peer=tail))
        except SwarmError as exc:
            self.epochs.end(f"result link: {exc}", only=ep)

    def start_swallowing(self) -> None:
        """Fault injection: this epoch's stage drops every frame it reads and the node stays up,
        answering heartbeats (a hop whose stream died silently, as a relayed one can). A new
        epoch's stage serves normally."""
        self.notices.notice("fault injection: this node's stage drops what it receives in this epoch")
        ep = self.epochs.current
        if ep is not None and ep.worker is not None:
            ep.worker.swallow = True

    def start_corrupting(self) -> None:
        """Fault injection for chaos tests: from now on our stage's outputs are NaN."""
        self.notices.notice("fault injection: this node now sends NaN activations")
        self.corrupt = True
        ep = self.epochs.current
        if ep is not None and ep.worker is not None:
            ep.worker.corrupt_after = 0


async def door_open(host: Host, fastpath: Any, peer: str, timeout: float) -> bool:
    """Whether ``peer`` takes an activation channel from us: a ``probe`` hello on a fast channel
    (the libp2p act stream without a fast path), echoed within ``timeout``. The leader's own
    evidence about a hop into ``peer`` that failed at set-up (authority.setup_blame)."""
    try:
        with trio.fail_after(timeout):
            if fastpath is not None:
                link = FrameLink(await fastpath.dial(peer, timeout=timeout))
                try:
                    await probe_once(link, timeout=timeout)
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                        await link.close()
            else:
                async with host.open_stream(peer, PROTO_ACT, timeout=timeout) as fs:
                    await probe_once(fs, timeout=timeout)
    except (SwarmError, trio.TooSlowError) as exc:
        log.warning("the activation door of %s did not answer the leader's probe: %s", peer, exc)
        return False
    return True
