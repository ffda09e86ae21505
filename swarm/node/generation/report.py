"""What a node reports: a generation's receipt, and its status (``shard-swarm status``).

A receipt says everything needed to check a run against one box (``shard-swarm run --receipt``):
the peers and their blocks, the plan, the RTTs, the prompt and output token ids with their
hash, the sampling and draft settings, timings, and every re-plan the run went through. Status
is what this node sees: members, leader, the serving plan, per-peer device and heartbeat age,
how each hop travels, recent throughput, how long the trio loop was held, and capacity.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from swarm import __version__
from swarm.model.driver import GenerationResult
from swarm.model.sampling import SamplingParams
from swarm.node.compute.memory import measured_memory
from swarm.node.compute.runtime import Models
from swarm.node.hosting import Host
from swarm.node.loopwatch import LoopWatch
from swarm.node.members.gossip import MembershipService
from swarm.node.members.view import MemberView
from swarm.node.plan.epochs import Epoch, Epochs, hops
from swarm.node.plan.wiring import Wiring
from swarm.node.ring.capacity import SlotQueue
from swarm.node.settings import peak_bytes
from swarm.planner import Plan
from swarm.planner.budget import predicted_peak
from swarm.proto.text import clean

STATUS_OTHER_ADVERTS = 32  # adverts of non-members a status reply lists (without RTTs)
RUNS_KEPT = 30  # generations a status reply summarises one by one (``runs``)
STATUS_BUDGET = 48 * 1024  # bytes of JSON a status reply may take (the frame's metadata cap is 64 KiB)
DEVICE_CHARS = 80  # of a member's "kind:name", as status shows it (control characters dropped)


class Reporter:
    def __init__(
        self, peer_id: str, host: Host, service: MembershipService, view: MemberView, epochs: Epochs, wiring: Wiring,
        models: Models, admission: SlotQueue, loopwatch: LoopWatch,
    ) -> None:  # fmt: skip
        self.peer_id = peer_id
        self.host = host
        self.service = service
        self.view = view
        self.epochs = epochs
        self.wiring = wiring
        self.models = models
        self.admission = admission
        self.loopwatch = loopwatch
        self.recent: collections.deque[tuple[float, float | None]] = collections.deque(maxlen=20)
        # one line per generation this node coordinated, for the console's speed history
        self.runs: collections.deque[dict[str, Any]] = collections.deque(maxlen=RUNS_KEPT)

    def receipt(self, ep: Epoch, gen: GenerationResult, params: SamplingParams, *, started: float,
                replans: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:  # fmt: skip
        """The run's receipt; ``replans``: the rings it left before ``ep``'s (resume.py)."""
        plan = ep.plan
        view = self.service.membership.view()
        pf = self.service.membership.peers_file()
        peers = []
        for pid in sorted({plan.coordinator, *plan.ring, *plan.standbys}):
            adv = view.get(pid)
            peers.append({
                "id": pid,
                "addresses": list(adv.addrs) if adv else [],
                "device": f"{adv.device_kind}:{adv.device_name}" if adv else "",
                "memory_bytes": adv.memory_bytes if adv else 0,
                "ms_per_layer": adv.layer_us / 1000 if adv else None,
                "block": list(plan.blocks[pid]) if pid in plan.blocks else None,
                "role": "coordinator" if pid == plan.coordinator else ("stage" if pid in plan.blocks else "standby"),
                # how its stage ran the decode steps: compiled spans and eager_from, or eager and why
                # (control.StageRun, as its loaded reply said); None: no block, or not started with --compile
                "compiled": ep.compiled.get(pid),
            })  # fmt: skip
        tms = gen.traversal_ms
        self.runs.append({"ended_unix": round(time.time(), 3), "epoch": plan.epoch, "tokens": len(gen.output_token_ids),
                          "tokens_per_s": round(gen.tokens_per_s, 3), "accepted_per_traversal": gen.tokens_per_traversal,
                          "traversal_ms": round(statistics.median(tms), 3) if tms else None})  # fmt: skip
        s = self.models.settings
        assert s.model_dir is not None
        return {
            "version": __version__,
            "model": {"name": s.model_dir.name, "config_sha256": self.models.ckpt.config_sha256},
            "quant": s.quant,
            # how this coordinator held the LM head (a quantized swarm's: int8 where stored so,
            # capability.swarm_head_quant); run --receipt holds it the same way
            "head_quant": self.models.head_quant,
            "kv_cache": s.kv_cache,  # how every stage held its KV cache (run --receipt holds it the same way)
            # what this (the coordinator's) node fetched of the model, and from where (swarm.fetch)
            "fetched": None if self.models.fetch is None else {
                "bytes": self.models.fetch.fetched_bytes, "sources": list(s.origin)},
            "peers": peers,
            "coordinator": plan.coordinator,
            "ring": list(plan.ring),
            "epoch": plan.epoch,
            "rtt_ms": pf.get("rtt_ms", {}),
            "prompt_token_ids": gen.prompt_token_ids,
            "output_token_ids": gen.output_token_ids,
            "output_sha256": gen.output_sha256,
            "finish_reason": gen.finish_reason,
            "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                         "seed": params.seed},  # fmt: skip
            "tokens_per_s": gen.tokens_per_s,
            "decode_tokens_per_s": gen.decode_tokens_per_s,
            "prefill_s": gen.prefill_s,  # from the request to the first token: the prompt through the ring
            "traversal_ms": statistics.median(tms) if tms else None,
            "accepted_per_traversal": gen.tokens_per_traversal,
            "accepted_per_round": gen.accepted_per_round,
            # LM head calls shared with other sessions: fp32 greedy tokens equal running alone; in bf16 a
            # near-tie can flip (coordinator.py); stages compute each session's rows alone (model/batched.py)
            "shared_head_calls": gen.shared_head_calls,
            "chunks": len(gen.chunks),
            "predicted_traversal_ms": plan.predicted_traversal_ms,
            "hops": hop_report(ep),
            "replans": list(replans),
            "started_unix": started,
            "replay_note": replay_note(ep.compiled, *(r.get("compiled") or {} for r in replans)),
        }

    def status(self, *, loop_window_s: int = 60) -> dict[str, Any]:
        """This node's status, bounded by construction (``bounded``): members describe themselves,
        and what they say is cleaned and cut, never a reason for the reply to fail."""
        return bounded(self._status(loop_window_s))

    def _status(self, loop_window_s: int) -> dict[str, Any]:
        ep = self.epochs.serving
        plan = ep.plan if ep is not None else None
        worker = ep.worker if ep is not None else None
        return {
            "peer_id": self.peer_id,
            "members": self.view.members(),
            "leader": self.view.leader(),
            "epoch": plan.epoch if plan else None,
            "serving": bool(ep is not None and ep.serving.is_set()),
            "plan": {"coordinator": plan.coordinator, "ring": list(plan.ring),
                     "blocks": {p: list(b) for p, b in plan.blocks.items()}, "standbys": list(plan.standbys),
                     "cause": ep.cause if ep is not None else "", "n_layers": plan.n_layers,
                     # the plan's prediction, one-way hops and each stage's compute (where a traversal's time goes)
                     "hops_ms": list(plan.hops_ms), "predicted_compute_ms": plan.predicted_compute_ms,
                     "predicted_traversal_ms": plan.predicted_traversal_ms}
            if plan else None,
            # members with RTTs, plus a few other adverts: made-up ones must not make the reply too big
            "peers_file": self.service.membership.peers_file(members=set(self.view.members()), others=STATUS_OTHER_ADVERTS),
            "ms_per_layer": self.models.ms_per_layer,
            # join --compile: the spans compiled, or why this stage serves eagerly (None: not asked)
            "compiled": self.models.compiled,
            "context_tokens": self.models.context_tokens,  # the swarm's context as this node serves it
            "hop_paths": {str(k): v for k, v in self.wiring.hop_paths.items()},
            "hops": hop_report(ep) if ep is not None else [],
            "peer_info": self._peer_info(plan),
            "recent": self._recent(),
            "runs": list(self.runs),
            "replans": list(self.epochs.replans),
            "loop": self.loopwatch.summary(loop_window_s),  # how long the trio loop was held (loopwatch.py)
            "stage": dataclasses.asdict(worker.stats) if worker is not None else None,  # this epoch's batching
            "memory": self._memory(plan),  # this node's predicted peak beside its measured one
            "capacity": {"sessions": self.admission.capacity, "active": self.admission.active, "queued": self.admission.queued,
                         "stage_sessions": worker.max_sessions if worker is not None else None},  # fmt: skip
            # what this epoch's stage and coordinator hold now: back to zero when no generation runs
            "held": {"stage": worker.held() if worker is not None else None,
                     "coordinator": ep.coordinator.held() if ep is not None and ep.coordinator is not None else None},
        }

    def _memory(self, plan: Plan | None) -> dict[str, Any]:
        """This node's whole predicted peak (real bytes: planner/budget.py), and at load, and what
        the OS measured of it (VmHWM, VmRSS; None where there is no /proc)."""
        s, m = self.models.settings, self.models
        block = plan.blocks.get(self.peer_id) if plan is not None else None
        coord = plan is not None and plan.coordinator == self.peer_id
        draft = (self.service.membership.local.draft_bytes or 0) if coord else 0  # as the planner counts it
        predicted = at_load = None  # a standby predicts nothing for a block it does not hold
        if block or coord:
            predicted, at_load = (peak_bytes(m.args, m.dtype, s.device, m.spec, block or (0, 0), coordinator=coord,
                                             draft_bytes=draft, at_load=load, quant=s.quant)
                                  for load in (False, True))  # fmt: skip
        hwm, rss = measured_memory()
        return {"offered_bytes": s.memory_bytes or None, "predicted_peak_bytes": predicted,
                "predicted_load_peak_bytes": at_load, "measured_peak_bytes": hwm, "measured_rss_bytes": rss}  # fmt: skip

    def _recent(self) -> dict[str, Any]:
        """Medians over the last generations this node coordinated."""
        if not self.recent:
            return {}
        tps = [t for t, _ in self.recent]
        acc = [a for _, a in self.recent if a is not None]
        return {"tokens_per_s": statistics.median(tps), "accepted_per_traversal": statistics.median(acc) if acc else None,
                "generations": len(self.recent)}  # fmt: skip

    def _peer_info(self, plan: Plan | None) -> dict[str, Any]:
        """What this node sees of every member: device, memory its block uses, heartbeat age, path."""
        view = self.service.membership.view()
        detector = self.service.liveness.detector
        spec = self.models.spec
        now = self.service.liveness.clock()
        out: dict[str, Any] = {}
        members = set(self.view.members())
        others = [p for p in view if p not in members][:STATUS_OTHER_ADVERTS]
        for peer in [p for p in view if p in members] + others:
            adv = view[peer]
            heard = detector.last_heard(peer)
            block = plan.blocks.get(peer) if plan is not None else None
            coord = plan is not None and plan.coordinator == peer
            # the planned part of its peak, against its advert (planner/budget.py)
            own = spec.at_width(adv.dtype_bytes) if adv.dtype_bytes else spec  # as the planner counts it (Peer.own)
            used = predicted_peak(own, block or (0, 0), coordinator=coord, draft_bytes=adv.draft_bytes or 0,
                                  sessions=adv.sessions) \
                if block or coord else 0
            out[peer] = {
                "device": clean(f"{adv.device_kind}:{adv.device_name}", DEVICE_CHARS),
                "memory_used_bytes": used,
                "heartbeat_age_s": None if peer == self.peer_id or heard is None else round(now - heard, 2),
                "path": "self" if peer == self.peer_id else self.host.path_label(peer),  # direct, hole-punched, relayed
                "rtt_ms": None if peer == self.peer_id else self.service.liveness.rtt_ms(peer),
                # "probe": measured on the path hops take (probe.py); "heartbeats": on the control stream
                "rtt_from": None if peer == self.peer_id else self.service.liveness.rtt_source(peer),
            }
        return out


def bounded(status: dict[str, Any], budget: int = STATUS_BUDGET) -> dict[str, Any]:
    """``status`` cut until its JSON fits ``budget`` bytes, in this order: the other adverts'
    details, then the RTT matrix, then the epoch history, then every member's details (each cut
    is named under "truncated"). What is left (IDs, the plan, counters) is small for any swarm
    the advert book admits."""
    cuts: list[tuple[str, Any]] = [
        ("other adverts", lambda st: _members_only(st)),
        ("rtt_ms", lambda st: st["peers_file"].pop("rtt_ms", None)),
        ("replans", lambda st: st.update(replans=st["replans"][-5:])),
        ("peer_info", lambda st: st.update(peer_info={})),
        ("peers_file", lambda st: st["peers_file"].update(peers=st["peers_file"]["peers"][:32])),
    ]
    st = dict(status)
    done: list[str] = []
    for name, cut in cuts:
        if len(json.dumps(st, default=str, ensure_ascii=False).encode("utf-8", "replace")) <= budget:
            break
        cut(st)
        done.append(name)
        st["truncated"] = done
    return st


def _members_only(st: dict[str, Any]) -> None:
    members = set(st.get("members") or ())
    pf = st["peers_file"] = dict(st["peers_file"])
    pf["peers"] = [p for p in pf.get("peers", []) if p.get("id") in members]
    st["peer_info"] = {p: v for p, v in st["peer_info"].items() if p in members}


def replay_note(*rings: dict[str, dict[str, Any]]) -> str | None:
    """What a reader of a receipt must know before replaying it with ``run --receipt`` (eager):
    stages that ran compiled in bf16 or fp16 may flip a near-tie against an eager box
    (model/compiled.py), so the receipt is no bit-exact reference; None where nothing says so
    (fp32 compiled stages give eager's tokens). ``rings``: how each ring the run went through
    ran its stages (peer -> control.StageRun), the last one and those a re-plan left."""
    dtypes = {p: c["dtype"] for ring in rings for p, c in ring.items() if c["spans"] and c["dtype"] != "fp32"}
    loose = sorted(dtypes)
    if not loose:
        return None
    return (f"{len(loose)} stage(s) ran compiled in {'/'.join(sorted(set(dtypes.values())))} "
            f"({', '.join(p[:16] for p in loose)}): a near-tie may flip against an eager box, so this receipt is "
            "not a bit-exact reference for run --receipt (README, Compiled nodes)")


def hop_report(ep: Epoch) -> list[dict[str, str]]:
    """Each hop of the ring with how it travels (the leader collected it at set-up)."""
    return [{"from": a, "to": b, "path": ep.hop_labels.get(i, "?")} for i, (a, b) in enumerate(hops(ep.plan))]
