"""The coordinator's drafting: the draft model a node holds, which drafter a request gets, and
drafting off the event loop.

Theory of operation
-------------------
A node holds at most one draft model (``join --draft``, swarm.model.draftload), loaded when it
first coordinates and kept across epochs like its head. Each generation drafts through its own
``ModelDrafter`` (its own KV cache) over those weights. The drafter belongs to the run
(coordinator.RingRun), so a re-plan never touches it: the resumed run replays its chunks on the
new ring and drafts on from the cache it has.

Off the loop. A draft model's forward never runs on the trio thread, which answers heartbeats.
The decoder hands out chunks one at a time (``SpeculativeDecoder.poll_iter``); with a model
drafter each next chunk is made in a worker thread behind the node's draft limiter (one draft
forward at a time) and sent as soon as it exists, so a chunk is on the wire while the next one's
drafts are computed, and the drafts of the chunks in flight are the context of the next ones
(drafting ahead on unverified tokens; a rejection discards the chunks after it, and the next
proposal rolls the draft's cache back to the common prefix). The prompt runs into the draft's
cache while the ring prefills. The decoder is asked in the order a plain ``poll()`` asks it, so
the chunk schedule is the one-box reference's (``shard-swarm run --receipt``).

Choosing (``DraftHolder.choose``). A request names ``none``, ``ngram``, ``model`` (or the draft's
own name) or ``auto``. auto decides between the draft model and none: each one's tokens per ms on
this ring come from the policy's time model (``KPolicy.rate``, best K and depth): none is one
token per traversal, the model drafts at its measured ms per token and at the acceptance this node
measured over its past generations (an EMA; a prior until it has one). The model must beat none
by ``AUTO_MARGIN``, else none runs: a draft that costs more than it saves on this ring (a LAN of
fast machines) is not used. The receipt says which drafter ran, why, and with which figures.
Prompt lookup is not auto's to pick: what it gains depends on whether the text repeats (6x on a
copied passage, 1.0x on chat, benchmarks/results/ring.json), not on the ring, so it stays the
request's own choice (``ngram``, the default without a draft model).

Sharing the ring. Prompt lookup pays on text that repeats and about nothing on chat (0.9
committed tokens per chunk measured on the bundled model), and alone that is free: the stages
would idle otherwise. On a ring shared by other generations it is not: the stages batch every
session's chunk into one forward (stage_worker.py), so a session's drafted rows and the chunks it
keeps in flight behind them (discarded at a rejection) are compute taken from the others'
forwards (8 chat sessions on the bundled 3-peer LAN ring, one run each: 59 tok/s in all with it, 75 without,
where plain decoding met the ring's compute: a traversal of 77 ms, one 8-session forward per
stage). So a generation that got prompt lookup *by default* (the request named no drafter)
decodes plainly when other generations share its ring as its decoding begins
(``Choice.shared``; the coordinator asks once, when the prefill's first result is in, before any
decode chunk: a schedule a decoder without a drafter issues, so the receipt's ``ran: none``
replays it). One named by the request keeps it; one that began alone keeps drafting when others
join.

What the policy weighs is measured: the traversal with one chunk in flight (an EMA over this
epoch's generations; the plan's prediction, from measured RTTs and ms per layer, until then), how
much each further chunk in flight slowed a traversal (``congestion``: near 0 where every stage has
machines of its own, more where they share cores), the draft's ms per token (at load, then an EMA
of its proposals) and the acceptance (the policy starts from this node's EMA instead of a guess).
They are fixed when a generation starts and recorded in the receipt (``draft.policy``), so its
schedule stays a pure function of its results and ``run --receipt`` replays it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import trio

from swarm.errors import SwarmError, UsageError
from swarm.model.config import ModelArgs
from swarm.model.drafters import DraftModel, ModelDrafter, NgramDrafter
from swarm.model.draftload import DraftSpec, draft_weight_bytes, load_draft_model, parse_draft
from swarm.model.speculative import DraftSource, KPolicy, SpeculativeDecoder, VerifyChunk
from swarm.model.stage import Head
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import Checkpoint

if TYPE_CHECKING:
    from swarm.node.compute.runtime import Compute

log = logging.getLogger("swarm.node.compute.drafting")

# Acceptance assumed before this node has measured any (per token; an EMA of measured rates
# replaces it): prompt lookup on chat measured 0.2 here; a model draft of the same family 0.5-0.97.
PRIOR_ALPHA = {"ngram": 0.2, "model": 0.7}  # ngram's: measured, not used by auto (see the module doc)
ALPHA_WEIGHT = 0.3  # weight of each generation in the acceptance EMA
AUTO_MARGIN = 1.1  # auto drafts only when that is predicted 10 % faster than not drafting
# Each extra token of a verify chunk costs this fraction of a one-token pass on the ring's stages
# (measured on the bundled model, bf16, native-bf16 CPU: 4 tokens 1.17x, 8 tokens 1.40x one token).
VERIFY_FRACTION = 0.06
REQUEST_NAMES = ("none", "ngram", "model", "auto")


@dataclass(frozen=True)
class RingTimes:
    """What a traversal of this ring costs, from the plan (measured RTTs and ms per layer)."""

    ring_ms: float  # one-token chunk, send to result
    stage_ms: float  # the slowest stage, one token
    verify_ms: float  # each extra token of a chunk, over the whole ring

    @classmethod
    def of(cls, traversal_ms: float, compute_ms: float, stage_ms: list[float]) -> RingTimes:
        return cls(max(traversal_ms, 0.05), max([*stage_ms, 0.01]), VERIFY_FRACTION * compute_ms)


@dataclass
class Choice:
    """The drafter one generation gets, and the words and figures its receipt shows."""

    requested: str
    ran: str  # none, ngram, or the draft model's name
    why: str
    drafter: DraftSource | None
    policy: KPolicy | None
    depth: int
    draft_k: int | None
    predicted_tok_s: dict[str, float] = field(default_factory=dict)
    # the node's default prompt lookup (not one the request named) stands down when the ring is
    # shared as decoding begins (``shared``: module doc, "Sharing the ring")
    yields: bool = False
    shared_with: int = 0  # other generations on the ring when decoding began, if it stood down

    def shared(self, others: int) -> Choice | None:
        """The choice when ``others`` generations share the ring as this one starts decoding:
        plain decoding in place of a default prompt lookup; None: unchanged."""
        if not (self.yields and others > 0):
            return None
        why = (f"{self.ran} by default, not run: {others} other generation{'s' if others > 1 else ''} shared "
               "the ring when decoding began (its drafts and the chunks behind them cost their forwards compute)")
        return dataclasses.replace(self, ran="none", why=why, drafter=None, policy=None, yields=False,
                                   shared_with=others)  # fmt: skip

    def receipt(self, dec: SpeculativeDecoder | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.requested, "ran": self.ran, "why": self.why,
            "max_depth": self.depth if self.drafter is not None else 1, "draft_k": self.draft_k,
        }  # fmt: skip
        if self.policy is not None and self.policy.ring_ms > 0:
            out["policy"] = self.policy.settings()
        if self.predicted_tok_s:
            out["predicted_tok_s"] = {k: round(v, 2) for k, v in self.predicted_tok_s.items()}
        if self.shared_with:
            out["shared_with"] = self.shared_with
        if dec is not None and dec.stats.mean_in_flight is not None:
            out["mean_in_flight"] = round(dec.stats.mean_in_flight, 3)
        if isinstance(self.drafter, ModelDrafter) and self.drafter.forwards:
            out["draft_ms_per_forward"] = round(1000 * self.drafter.busy_s / self.drafter.forwards, 3)
            out["drafted_ahead"] = self.drafter.ahead_hits  # proposed tokens ready before they were asked for
        return out

    def close(self) -> None:
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.close()


class DraftHolder:
    """A node's drafting: its ``--draft``, the draft model once loaded, what it has measured."""

    def __init__(self, spec: DraftSpec | str, compute: Compute | None = None) -> None:
        from swarm.node.compute.runtime import Compute  # (runtime.py imports this module)

        self.spec = parse_draft(spec) if isinstance(spec, str) else spec
        self.model: DraftModel | None = None
        self.limiter = trio.CapacityLimiter(1)  # draft forwards, one at a time, in a worker thread
        self.compute = compute or Compute()  # where the draft model loads (runtime.py)
        self.draft_ms: float | None = None  # measured when loaded, then an EMA of real proposals
        self.alpha: dict[str, float] = {}  # measured acceptance per drafter (ngram, model)
        self.load_error: str | None = None
        self.budgeted = False  # whether the serving epoch's plan has room for the draft model
        self.epoch: int | None = None  # the ring the figures below were measured on
        self.t1_ms: float | None = None  # traversal with one chunk in flight, measured (EMA)
        self.congestion: float | None = None  # slow-down per further chunk in flight, measured (EMA)

    @property
    def default_request(self) -> str:
        """What a request that names no drafter gets."""
        if self.spec.auto:
            return "auto"
        return "model" if self.spec.model else self.spec.kind

    def advert(self, args: ModelArgs, dtype: torch.dtype, ms_per_layer: float,
               context_tokens: int) -> tuple[str, int, float] | None:
        """(name, bytes, ms per drafted token) for our advert, estimated before loading: the
        draft's weights and a context's KV cache; its time as ms per layer scaled by the weight
        bytes read per token (a token's decode reads every weight once)."""
        if not self.spec.model:
            return None
        nbytes = torch.empty(0, dtype=dtype).element_size()
        weights, kv = draft_weight_bytes(self.spec, args, nbytes)
        read = weights + (args.head_bytes(nbytes) if self.spec.path is None else 0)
        ms = self.draft_ms if self.draft_ms is not None else ms_per_layer * read / max(args.layer_bytes(nbytes), 1)
        return self.spec.label, weights + kv * context_tokens, ms

    async def use(self, budgeted: bool, *, head: Head, ckpt: Checkpoint, dtype: torch.dtype, device: str,
                  tokenizer: Tokenizer | None, notice: Callable[[str], None]) -> None:
        """As an epoch's coordinator: load the draft model (once) when the plan budgets its memory
        (``Plan.draft``), else free it. A draft that cannot load is reported and not used: the
        node coordinates without it."""
        self.budgeted = budgeted
        if not budgeted:
            if self.model is not None:
                notice("this epoch's plan has no room for the draft model: coordinating without it")
            self.model = None
            return
        if not self.spec.model or self.model is not None or self.load_error is not None:
            return
        def load() -> tuple[DraftModel, float]:
            model = load_draft_model(self.spec, head=head, target=ckpt, dtype=dtype, device=device,
                                     target_tokenizer=tokenizer)  # fmt: skip
            return model, model.measure_ms()

        try:
            model, self.draft_ms = await self.compute.run(load, limiter=self.limiter)
        except (SwarmError, OSError, RuntimeError) as exc:
            self.load_error = str(exc)
            notice(f"draft model {self.spec} not loaded ({exc}); coordinating without it")
            return
        self.model = model
        notice(f"draft model {model.name} loaded: {model.nbytes() / 1e6:.0f} MB, {self.draft_ms:.1f} ms per token")

    # -- choosing ------------------------------------------------------------------------

    def choose(self, request: str, *, times: RingTimes, depth: int, draft_k: int | None,
               max_len: int, epoch: int | None = None) -> Choice:
        """The drafter and policy for one generation (see the module doc); ``times`` are the
        plan's predictions for ring ``epoch``, replaced by what was measured on it."""
        if epoch != self.epoch:  # another ring: what was measured on the last one does not hold
            self.epoch, self.t1_ms, self.congestion = epoch, None, None
        if self.t1_ms is not None:
            times = dataclasses.replace(times, ring_ms=self.t1_ms)
        name = self.default_request if request in ("", "default") else request
        if name == "none":
            return Choice(name, "none", "asked for", None, None, depth, draft_k)
        if name == "ngram":  # the ring's drafter before draft models: its policy unchanged
            default = request in ("", "default")
            return Choice(name, "ngram", "the default" if default else "asked for", NgramDrafter(),
                          KPolicy(max_depth=depth, fixed_k=draft_k, draft_cost=0.0), depth, draft_k,
                          yields=default)  # fmt: skip
        if name == "auto":
            return self._auto(times, depth, draft_k, max_len)
        if name not in ("model", self.spec.label) and not (self.model is not None and name == self.model.name):
            raise UsageError(
                f"unknown draft {name!r}: choose none, ngram, model, auto"
                + (f" or {self.spec.label}" if self.spec.model else "")
            )
        if self.model is None:
            raise UsageError(f"draft {name!r}: this coordinator cannot draft with a model: {self._why_no_model()}")
        return self._model_choice(name, "asked for", times, depth, draft_k, max_len, {})

    def _policy(self, times: RingTimes, depth: int, draft_k: int | None, draft_ms: float) -> KPolicy:
        return KPolicy(max_depth=depth, fixed_k=draft_k, verify_cost=VERIFY_FRACTION, draft_cost=0.0,
                       ring_ms=times.ring_ms, draft_ms=draft_ms, verify_ms=times.verify_ms,
                       stage_ms=times.stage_ms, congestion=self.congestion or 0.0,
                       alpha=self.alpha.get("model", PRIOR_ALPHA["model"]))  # fmt: skip

    def _model_choice(self, name: str, why: str, times: RingTimes, depth: int, draft_k: int | None,
                      max_len: int, predicted: dict[str, float]) -> Choice:
        assert self.model is not None and self.draft_ms is not None
        limit = min(max_len, self.model.args.max_seq_len)
        policy = self._policy(times, depth, draft_k, self.draft_ms)
        return Choice(name, self.model.name, why, self.model.drafter(limit), policy, depth, draft_k, predicted)

    def predict(self, times: RingTimes, depth: int, draft_k: int | None) -> dict[str, float]:
        """Predicted tokens per second of each candidate on this ring (auto's figures)."""
        out = {"none": 1000.0 / times.ring_ms}
        if self.model is not None and self.draft_ms is not None:
            policy = self._policy(times, depth, draft_k, self.draft_ms)
            alpha = self.alpha.get("model", PRIOR_ALPHA["model"])
            k, d = policy.plan(alpha)
            out["model"] = 1000.0 * policy.rate(k, d, alpha)
        return out

    def _auto(self, times: RingTimes, depth: int, draft_k: int | None, max_len: int) -> Choice:
        pred = self.predict(times, depth, draft_k)
        if "model" not in pred:
            why = f"no draft model to choose ({self._why_no_model()})"
            return Choice("auto", "none", why, None, None, depth, draft_k, pred)
        best = "model"
        basis = ", ".join(
            f"{k} {pred[k]:.1f}" + (f" (acceptance {self.alpha.get(k, PRIOR_ALPHA[k]):.2f}"
                                    f"{'' if k in self.alpha else ' assumed'})" if k != "none" else "")
            for k in pred
        )  # fmt: skip
        measured = "measured" if self.t1_ms is not None else "predicted"
        ring = f"ring {times.ring_ms:.1f} ms per traversal ({measured})" + (
            f", draft {self.draft_ms:.1f} ms per token" if self.draft_ms is not None else "")  # fmt: skip
        if pred[best] < AUTO_MARGIN * pred["none"]:
            why = f"no drafter pays on this ring ({ring}): predicted tok/s {basis}"
            return Choice("auto", "none", why, None, None, depth, draft_k, pred)
        why = f"predicted tok/s {basis} ({ring})"
        return self._model_choice("auto", why, times, depth, draft_k, max_len, pred)

    def _why_no_model(self) -> str:
        if self.load_error:
            return f"its draft model {self.spec} did not load: {self.load_error}"
        if self.spec.model:
            return f"the plan has no room for its draft model {self.spec} (see the plan's note)"
        return f"it holds no draft model (join --draft {self.spec})"

    def learn(self, choice: Choice, dec: SpeculativeDecoder, traversal_ms: list[float] | None = None,
              epoch: int | None = None) -> None:
        """Fold one generation's acceptance, draft speed and traversal times (ring ``epoch``)
        into what the next generations' policies and auto's choice start from."""
        if traversal_ms and epoch == self.epoch:
            t, depth = statistics.median(traversal_ms), dec.stats.mean_in_flight or 1.0
            if depth <= 1.2:
                self.t1_ms = t if self.t1_ms is None else (1 - ALPHA_WEIGHT) * self.t1_ms + ALPHA_WEIGHT * t
            elif depth >= 1.5 and self.t1_ms is not None:
                c = max(0.0, (t / self.t1_ms - 1) / (depth - 1))
                old_c = self.congestion
                self.congestion = c if old_c is None else (1 - ALPHA_WEIGHT) * old_c + ALPHA_WEIGHT * c
        kind = "model" if isinstance(choice.drafter, ModelDrafter) else choice.ran
        if kind in PRIOR_ALPHA and dec.stats.proposed:
            rate = dec.stats.accepted / dec.stats.proposed
            old = self.alpha.get(kind)
            self.alpha[kind] = rate if old is None else (1 - ALPHA_WEIGHT) * old + ALPHA_WEIGHT * rate
        d = choice.drafter
        if isinstance(d, ModelDrafter) and d.forwards > 1 and self.draft_ms is not None:
            # per forward of the proposals (a prompt's prepare forward excluded when we can tell)
            ms = 1000 * d.busy_s / d.forwards
            if math.isfinite(ms):
                self.draft_ms = (1 - ALPHA_WEIGHT) * self.draft_ms + ALPHA_WEIGHT * ms


def draft_bytes(draft: str, args: ModelArgs, dtype: torch.dtype, context_tokens: int) -> int:
    """What ``--draft`` adds to a coordinator's memory: weights and a context's KV (0 without a model)."""
    weights, kv = draft_weight_bytes(parse_draft(draft), args, torch.empty(0, dtype=dtype).element_size())
    return weights + kv * context_tokens


T = TypeVar("T")


async def drafting_ahead(dec: SpeculativeDecoder, compute: Compute, limiter: trio.CapacityLimiter,
                         wait: Callable[[], Awaitable[T]]) -> T:
    """``await wait()`` (the next result), while the draft model drafts the next chunk in a worker
    thread, assuming the chunks in flight are accepted (module doc). When the result comes the
    drafting stops after its current forward; whatever was drafted is reused by the next proposal
    if the target agreed, and forgotten if not. Either way the drafts are the ones computed after
    the result would have been (drafters.py: history-independent numerics)."""
    d = dec.drafter
    if not compute.threads or not isinstance(d, ModelDrafter) or dec.done or not dec.inflight or not dec.drafter_prepared:
        return await wait()  # (inline compute: nothing runs while we wait)
    context, k = list(dec.speculated), dec.policy.choose()[0] + 1  # + 1: the bonus token, if all pass
    stop = threading.Event()

    def ahead() -> None:
        try:
            d.draft_ahead(context, k, dec.params, stop)
        except Exception as exc:  # an optimisation only: the next proposal drafts what it needs
            log.warning("drafting ahead failed: %s", exc)

    failed: BaseException | None = None
    out: T | None = None
    async with trio.open_nursery() as nursery:
        # abandoned when the result comes: the result is handled at once while the thread ends its
        # forward (the drafter's lock keeps the next proposal behind it; it frees the limiter then)
        run = functools.partial(compute.run, ahead, limiter=limiter, abandon_on_cancel=True)
        nursery.start_soon(run)
        try:
            out = await wait()
        except BaseException as exc:  # re-raised below, not wrapped in an exception group
            failed = exc
        finally:
            stop.set()
            nursery.cancel_scope.cancel()
    if failed is not None:
        raise failed
    return out  # type: ignore[return-value]


async def issue(dec: SpeculativeDecoder, chunks: Iterator[VerifyChunk], send: Callable[[VerifyChunk], Awaitable[None]],
                compute: Compute, limiter: trio.CapacityLimiter) -> None:
    """Send ``chunks`` (the decoder's ``poll_iter``, as the decode driver hands it out), each as
    soon as it exists; a drafter's work runs in a worker thread behind ``limiter`` (unless it says
    it is ``cheap``, as prompt lookup is, or ``compute`` runs inline: in-memory tests on a mock clock).
    After the prompt's prefill chunks, a draft model runs the prompt into its cache (while the ring
    prefills)."""
    offload = compute.threads and dec.drafter is not None and not getattr(dec.drafter, "cheap", False)
    prefill = False
    while True:
        chunk = await compute.run(next, chunks, None, limiter=limiter) if offload else next(chunks, None)
        if chunk is None:
            break
        prefill |= chunk.prefill
        await send(chunk)
    if prefill and offload:
        await compute.run(dec.prepare_drafter, limiter=limiter)
