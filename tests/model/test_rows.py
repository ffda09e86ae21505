"""One-token steps as one pass (swarm/model/rows.py): used only where proven, always bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarm.model import rows
from swarm.model.kvcache import KVCache
from swarm.model.stage import Stage
from swarm.model.weights import Checkpoint, open_checkpoint
from swarm.testing.checkpoints import TinySpec, write_checkpoint

SPEC = TinySpec(family="llama", n_layers=4, n_heads=4, n_kv_heads=2)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """As a node computes (one torch thread unless configured): the kernels, and so the probe's
    verdict, can depend on the thread count (here bf16 rows were exact with 1 thread, not with 2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    d: Path = tmp_path_factory.mktemp("rows")
    write_checkpoint(d, SPEC, seed=3)
    return open_checkpoint(d)


def _chunks(pattern: list[tuple[int, int]]) -> list[tuple[int, torch.Tensor]]:
    return [(p, torch.zeros(t, 8)) for p, t in pattern]


def test_row_units_group_consecutive_one_token_steps_by_proven_counts() -> None:
    stage = SimpleNamespace(rows_exact_memo={16: False, 8: True, 4: False, 2: True})
    # a prefill, 11 steps at 7..17, a verify chunk, a step that starts inside it (a rejected tail),
    # then a step that is not consecutive with it
    pattern = [(0, 7)] + [(p, 1) for p in range(7, 18)] + [(18, 3), (19, 1), (30, 1)]
    units = rows.row_units(stage, _chunks(pattern))
    assert units == [[0], list(range(1, 9)), [9, 10], [11], [12], [13], [14]]
    stage.rows_exact_memo = {n: False for n in rows.ROW_GROUPS}  # nothing proven: every chunk alone
    assert rows.row_units(stage, _chunks(pattern)) == [[k] for k in range(len(pattern))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_seq_rows_are_the_steps_bit_for_bit(ck: Checkpoint, dtype: torch.dtype, monkeypatch: Any) -> None:
    """A replay of 20 decoded tokens after a prefill gives the bits of the steps one by one,
    cache included, and takes the one-pass path exactly when the probe proved it here."""
    stage = Stage.load(ck.args, ck.source, 0, 4, dtype=dtype)
    proven = [n for n in rows.ROW_GROUPS if rows.rows_exact(stage, n)]  # probed before counting passes
    passes: list[int] = []
    real = rows.layer_rows
    monkeypatch.setattr(rows, "layer_rows", lambda layer, x, *a: passes.append(x.shape[1]) or real(layer, x, *a))
    gen = torch.Generator().manual_seed(11)
    hs = [(0, torch.randn(9, ck.args.dim, generator=gen).to(dtype))]
    hs += [(9 + i, torch.randn(1, ck.args.dim, generator=gen).to(dtype)) for i in range(20)]
    stage.open_session("one", 64)
    one = [stage.forward("one", h) for _, h in hs]
    stage.open_session("seq", 64)
    groups = [hs[:5], hs[5:]]  # as a stage takes them: a prefill and 4 steps, then 16 steps
    seq = [out for g in groups for out in stage.forward_seq("seq", g)]
    assert all(torch.equal(a, b) for a, b in zip(one, seq, strict=True))
    a, b = stage._cache("one"), stage._cache("seq")
    assert a.length == b.length == 29
    for i in a._k:
        assert torch.equal(a._k[i][:, :, :29], b._k[i][:, :, :29]) and torch.equal(a._v[i][:, :, :29], b._v[i][:, :, :29])
    merged = [len(u) for g in groups for u in rows.row_units(stage, g) if len(u) > 1]
    assert sorted(passes) == sorted(n for n in merged for _ in stage.layers)
    assert bool(passes) == bool(proven)  # one pass per layer per merged run, and only where proven


def test_a_proven_count_holds_on_other_values(ck: Checkpoint) -> None:
    """The probe's verdict is about the kernels (shapes, dtype, threads), not the values it ran:
    where it says exact, other steps through another layer are exact too."""
    stage = Stage.load(ck.args, ck.source, 0, 4, dtype=torch.bfloat16)
    layer = stage.layers[2]
    gen = torch.Generator().manual_seed(99)
    for n in rows.ROW_GROUPS:
        if not rows.rows_exact(stage, n):
            continue
        h = (3 * torch.randn(n, ck.args.dim, generator=gen)).to(torch.bfloat16)
        cos, sin = stage._rope_tables(40 + n)
        rope = [(cos[p : p + 1], sin[p : p + 1]) for p in range(40, 40 + n)]
        prefix = torch.randn(1, 40, ck.args.dim, generator=gen).to(torch.bfloat16)
        caches = []
        for _ in range(2):
            c = KVCache(64, dtype=torch.bfloat16, device="cpu")
            c.begin(40)
            layer(prefix, cos[:40], sin[:40], c, 0)
            c.advance(40)
            caches.append(c)
        steps = []
        for i, p in enumerate(range(40, 40 + n)):
            caches[0].begin(1)
            steps.append(layer(h[i : i + 1].unsqueeze(0), *rope[i], caches[0], p))
            caches[0].advance(1)
        together = rows.layer_rows(layer, h.unsqueeze(0), rope, caches[1], range(40, 40 + n))
        assert torch.equal(torch.cat(steps, dim=1), together)
        assert torch.equal(caches[0]._k[layer.layer_idx], caches[1]._k[layer.layer_idx])


def test_layers_that_are_not_hand_written_are_never_merged(ck: Checkpoint) -> None:
    stage = Stage.load(ck.args, ck.source, 0, 4, dtype=torch.bfloat16, runtime="transformers")
    assert not any(rows.rows_exact(stage, n) for n in rows.ROW_GROUPS)
