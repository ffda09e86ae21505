"""The generation service (node/generation/service.py) on its own: a GenService on an in-memory
host with no ring answers what it cannot serve with a typed failure and never by silence (a
request that is no request, no serving ring after the request's own wait, a swarm that cannot
hold the model), serves status, and ends a stream whose client never asks; its prompt (ids, or
text through the tokenizer, with the chat template and the BOS rule) and its ring depth from the
plan's predictions. Then on a whole in-memory swarm: a node that does not coordinate relays a
generation to the coordinator (same tokens), and a client that hangs up while its relayed request
waits in the coordinator's queue leaves that queue at once; a coordinator lost mid-relay fails
the relayed request promptly, naming it."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from tokenizers import Regex, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from swarm import client
from swarm.errors import BadRequest, CannotServe, PeerError, UsageError
from swarm.model.tokenizer import Tokenizer
from swarm.node.compute.runtime import Compute
from swarm.node.dispatch import CLIENT, MEMBER, Dispatcher
from swarm.node.generation.service import REQUEST_TIMEOUT_S, GenService
from swarm.node.notices import Hooks, Notices
from swarm.node.plan.epochs import Epochs
from swarm.node.ring.capacity import SlotQueue
from swarm.node.settings import NodeSettings
from swarm.planner import Plan
from swarm.proto import control as ctl
from swarm.proto.control import MAX_DEPTH
from swarm.proto.limits import PROTO_GEN
from swarm.testing.checkpoints import TinySpec, write_checkpoint
from swarm.testing.memnet import MemHost, MemNet
from swarm.testing.memswarm import MemSwarm

SECRET, SWARM = b"g" * 32, "gen-swarm"
pytestmark = pytest.mark.timeout(300)


class _View:
    """Roles as the host tells them; this node leads."""

    def __init__(self, host: MemHost) -> None:
        self.peer_id, self.host = host.peer_id, host

    def admitted_role(self, peer: str) -> str | None:
        return self.host.admitted_role(peer)

    def members(self) -> list[str]:
        return [self.peer_id]

    def leader(self) -> str:
        return self.peer_id


class _Reporter:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def status(self, *, loop_window_s: int = 60) -> dict[str, Any]:
        self.asked.append(loop_window_s)
        return {"peer_id": "me", "epoch": None}


def _service(host: MemHost, *, tokenizer: Tokenizer | None = None, problem: Callable[[], str | None] = lambda: None,
             ms_per_layer: float = 0.05, adverts: dict[str, Any] | None = None) -> tuple[GenService, _Reporter]:  # fmt: skip
    """A GenService on ``host`` whose node has taken no plan (real epochs, nothing serving)."""
    settings = NodeSettings(seed=b"\x01" * 32, swarm_id=SWARM, secret=SECRET, model_dir=None, chunk_timeout=3.0)
    view = _View(host)
    epochs = Epochs(settings, host.peer_id, None, SlotQueue(), Notices(Hooks()), leader=view.leader, memory=dict)  # type: ignore[arg-type]
    roles = Dispatcher(view, epochs.roles, {}, PROTO_GEN)
    membership = SimpleNamespace(view=lambda: adverts or {})
    models = SimpleNamespace(tokenizer=tokenizer, ms_per_layer=ms_per_layer, compute=Compute())
    reporter = _Reporter()
    svc = GenService(settings, host.peer_id, host, SimpleNamespace(service=SimpleNamespace(membership=membership)),  # type: ignore[arg-type]
                     epochs, models, SlotQueue(), reporter, None, roles, planning_problem=problem)  # type: ignore[arg-type]  # fmt: skip
    return svc, reporter


@contextlib.asynccontextmanager
async def _served(**kw: Any) -> AsyncIterator[tuple[MemHost, str, _Reporter]]:
    """A client host admitted to a node that serves gen/1 with a GenService and no ring."""
    net = MemNet(delay=0.001)
    async with (
        net.open_host(b"\x01" * 32, secret=SECRET, swarm_id=SWARM) as node,
        net.open_host(b"\x02" * 32, secret=SECRET, swarm_id=SWARM, member=False) as me,
    ):
        svc, reporter = _service(node, **kw)
        node.handle(PROTO_GEN, svc.serve, roles=(MEMBER, CLIENT))
        yield me, await me.dial(node.addrs()[0]), reporter


async def test_a_request_that_is_neither_generation_nor_status_is_refused_typed(autojump_clock: Any) -> None:
    async with _served() as (me, peer, _):
        with pytest.raises(BadRequest, match=f"peer {peer}: expected a gen or status request, got Ack"):
            await client.request(me, peer, ctl.Ack())


async def test_a_status_request_gets_this_nodes_status_over_the_window_asked(autojump_clock: Any) -> None:
    async with _served() as (me, peer, reporter):
        assert await client.status(me, peer, loop_window_s=7) == {"peer_id": "me", "epoch": None}
        assert reporter.asked == [7]


async def test_a_client_that_never_asks_is_not_answered_and_its_stream_ends_after_the_request_timeout(
    autojump_clock: Any,
) -> None:
    async with _served() as (me, peer, _), me.open_stream(peer, PROTO_GEN, timeout=5) as fs:
        t0 = trio.current_time()
        with pytest.raises(PeerError):
            await fs.receive_message(timeout=REQUEST_TIMEOUT_S + 10)
        assert REQUEST_TIMEOUT_S <= trio.current_time() - t0 < REQUEST_TIMEOUT_S + 1


async def test_without_a_serving_ring_a_generation_waits_what_it_asked_then_fails_typed(autojump_clock: Any) -> None:
    async with _served() as (me, peer, _):
        t0 = trio.current_time()
        with pytest.raises(PeerError, match=r"the swarm is not ready \(no plan yet\); retry in a few seconds"):
            await client.generate(me, peer, prompt_ids=[1, 2], max_new_tokens=2, wait_s=3.0)
        assert 3.0 <= trio.current_time() - t0 < 3.5
    async with _served(problem=lambda: "the live members are 2.0 GB short") as (me, peer, _):
        with pytest.raises(CannotServe, match="the swarm cannot serve: the live members are 2.0 GB short"):
            await client.generate(me, peer, prompt_ids=[1, 2], max_new_tokens=2)


async def test_a_request_that_crashes_the_service_is_answered_with_an_error_naming_the_node(autojump_clock: Any) -> None:
    """A bug while serving (here: the planning check raising) reaches the client as a typed
    failure naming the node and the error, not as a stream closed without a word (stop 40's CI
    failure read as a lost peer), and the node serves the next request."""

    def broken() -> str | None:
        raise ValueError("seconds must be non-negative")

    async with _served(problem=broken) as (me, peer, reporter):
        with pytest.raises(PeerError, match=rf"peer {peer} hit an internal error serving the request "
                                            r"\(ValueError: seconds must be non-negative\); its log has the traceback"):  # fmt: skip
            await client.generate(me, peer, prompt_ids=[1, 2], max_new_tokens=2)
        assert await client.status(me, peer) == {"peer_id": "me", "epoch": None}


def _tokenizer() -> Tokenizer:
    """One token per lower-case letter or space, a BOS, and a chat template."""
    vocab = {"<s>": 0, "<unk>": 1, " ": 2, **{chr(c): c - 94 for c in range(97, 123)}}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return Tokenizer(tok, {"bos_token": "<s>", "unk_token": "<unk>"}, where="test", chat_template=template)


async def test_the_prompt_is_the_ids_or_the_text_tokenized_then_the_ids_a_lost_coordinator_committed() -> None:
    net = MemNet()
    async with net.open_host(b"\x01" * 32, secret=SECRET, swarm_id=SWARM) as node:
        bare, _ = _service(node)
        assert await bare._prompt(ctl.Gen.checked([5, 6], max_new_tokens=1)) == [5, 6]
        with pytest.raises(UsageError, match="no tokenizer: send prompt token ids"):
            await bare._prompt(ctl.Gen.checked((), text="hi", max_new_tokens=1))

        tok = _tokenizer()
        svc, _ = _service(node, tokenizer=tok)
        ab = [ord("a") - 94, ord("b") - 94]
        # plain text: the BOS its tokenizer asks for, then the committed ids after it
        assert await svc._prompt(ctl.Gen.checked([40, 41], text="ab", max_new_tokens=1)) == [0, *ab, 40, 41]
        # chat: the template writes the prompt (its own specials: no BOS added); "[" is unknown here
        assert await svc._prompt(ctl.Gen.checked((), text="ab", chat=True, max_new_tokens=1)) == [1, *ab, 1]
        long = "ab " * 1000  # tokenized off the event loop: the same ids
        want = tok.encode(long, add_special_tokens=True)
        assert len(want) == 3001
        assert await svc._prompt(ctl.Gen.checked([7], text=long, max_new_tokens=1)) == [*want, 7]


def _plan(traversal_ms: float, blocks: dict[str, tuple[int, int]]) -> Plan:
    ring = tuple(blocks)
    return Plan(1, max(b for _, b in blocks.values()), ring[0], ring, blocks, (), traversal_ms / 2, traversal_ms / 2)


async def test_the_ring_depth_is_a_traversal_over_its_slowest_stage_within_bounds() -> None:
    net = MemNet()
    async with net.open_host(b"\x01" * 32, secret=SECRET, swarm_id=SWARM) as node:
        adverts = {"A": SimpleNamespace(layer_us=2000.0), "B": SimpleNamespace(layer_us=500.0)}
        svc, _ = _service(node, ms_per_layer=1.0, adverts=adverts)
        # stages: A 4 layers x 2 ms = 8 ms (the slowest); B 4 x 0.5 = 2 ms; C unadvertised: 2 x 1 ms (ours)
        plan = _plan(16.0, {"A": (0, 4), "B": (4, 8), "C": (8, 10)})
        assert svc._stage_ms(plan) == [8.0, 2.0, 2.0]
        assert svc.ring_depth(plan) == 2  # 16 ms / 8 ms
        assert svc.ring_depth(_plan(17.0, {"A": (0, 4), "B": (4, 8)})) == 3  # rounded up
        assert svc.ring_depth(_plan(4.0, {"A": (0, 4)})) == 1  # never below one chunk
        assert svc.ring_depth(_plan(1e6, {"A": (0, 4)})) == MAX_DEPTH  # nor above the protocol's bound
        assert svc.ring_times(plan).ring_ms == 16.0 and svc.ring_times(plan).stage_ms == 8.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=4), seed=21)


async def test_a_node_that_does_not_coordinate_relays_and_a_client_that_hangs_up_leaves_the_coordinators_queue(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(delay=0.01), ckpt, nursery, layers=[2, 2])  # a ring of two: a hop per token
        await swarm.start_all()
        plan = await swarm.ready()
        coord = swarm.index(plan.coordinator)
        other = 1 - coord
        direct = await swarm.generate(coord, [3, 1, 4], 6, draft="none")
        relayed = await swarm.generate(other, [3, 1, 4], 6, draft="none")
        assert relayed["output_token_ids"] == direct["output_token_ids"]
        assert relayed["coordinator"] == plan.coordinator

        # the coordinator's ring holds one generation at a time; a long one takes it
        admission = swarm.peers[coord].serving.admission
        admission.set_capacity(1)
        got: list[int] = []
        nursery.start_soon(functools.partial(swarm.generate, coord, [2, 7], 240, draft="none",
                                             on_tokens=lambda ids, text: got.extend(ids)))  # fmt: skip
        await swarm.until(lambda: len(got) >= 3, 30, "the first generation streaming")
        with trio.CancelScope() as scope:  # a second, relayed, waits in the coordinator's queue ...

            async def hang_up_while_queued() -> None:
                await swarm.until(lambda: admission.queued == 1, 5, "the relayed request queued")
                scope.cancel()  # ... and its client goes away

            nursery.start_soon(hang_up_while_queued)
            await swarm.generate(other, [3, 1, 4], 6, draft="none")
        assert scope.cancelled_caught
        t0 = trio.current_time()
        await swarm.until(lambda: admission.queued == 0, 2, "the coordinator dropping the queued request")
        assert trio.current_time() - t0 < 0.5  # at once: not when the first generation leaves its slot
        assert admission.active == 1 and len(got) < 200  # which still runs
        nursery.cancel_scope.cancel()


async def test_a_coordinator_lost_mid_relay_fails_the_relayed_request_promptly(ckpt: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        swarm = MemSwarm(MemNet(delay=0.01), ckpt, nursery, layers=[2, 2])
        await swarm.start_all()
        plan = await swarm.ready()
        coord = swarm.index(plan.coordinator)
        other = 1 - coord
        got: list[int] = []
        killed_at = [math.inf]

        async def kill_after_a_few_tokens() -> None:
            await swarm.until(lambda: len(got) >= 3, 30, "tokens streaming")
            swarm.kill(coord)
            killed_at[0] = trio.current_time()

        nursery.start_soon(kill_after_a_few_tokens)
        async with swarm.client(other) as (host, peer):
            with pytest.raises(PeerError, match=f"peer {plan.coordinator}"):  # the relay names the lost coordinator
                await client.generate(host, peer, prompt_ids=[3, 1, 4], max_new_tokens=240, draft="none",
                                      on_tokens=lambda ids, text: got.extend(ids))  # fmt: skip
        assert trio.current_time() - killed_at[0] < 1.0  # at once, not after a timeout
        assert 3 <= len(got) < 50
        nursery.cancel_scope.cancel()
