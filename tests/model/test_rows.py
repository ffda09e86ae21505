"""One-token steps as one pass (swarm/model/rows.py): used only where proven, always bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarm.model import rows
from swarm.model.llama_layers import DecoderLayer
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


def test_row_units_merge_small_chunks_up_to_proven_counts() -> None:
    # a prefill piece, 11 decode steps at 7..17, a verify chunk, a step inside it (a rejected
    # tail), a step further on, then a 64-token piece and one more step
    pattern = [(0, 7)] + [(p, 1) for p in range(7, 18)] + [(18, 3), (19, 1), (30, 1), (31, 64), (95, 1)]
    proven = SimpleNamespace(rows_exact_memo={n: True for n in range(2, 17)})
    assert rows.row_units(proven, _chunks(pattern)) == [list(range(0, 10)), list(range(10, 15)), [15], [16]]
    some = SimpleNamespace(rows_exact_memo={n: n <= 4 for n in range(2, 17)})  # e.g. a kernel that changes at 5 rows
    assert rows.row_units(some, _chunks(pattern)) == (
        [[0]] + [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]] + [[12, 13]] + [[14]] + [[15], [16]]
    )
    none = SimpleNamespace(rows_exact_memo={n: False for n in range(2, 17)})  # nothing proven: each alone
    assert rows.row_units(none, _chunks(pattern)) == [[k] for k in range(len(pattern))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_seq_merged_is_the_chunks_bit_for_bit(ck: Checkpoint, dtype: torch.dtype, monkeypatch: Any) -> None:
    """A replay of a prefill, decode steps and drafted rounds (verify chunks whose rejected tails
    the next chunk overwrites) gives the bits of the chunks one by one, cache included, and
    merges chunks exactly where the probe proved the row counts on this machine."""
    stage = Stage.load(ck.args, ck.source, 0, 4, dtype=dtype)
    pattern = [(0, 9), (9, 1), (10, 1), (11, 4), (13, 3), (14, 5), (19, 1), (20, 2), (22, 1)]
    pattern += [(23 + i, 1) for i in range(12)] + [(35, 4), (36, 1)]
    gen = torch.Generator().manual_seed(11)
    hs = [(p, torch.randn(t, ck.args.dim, generator=gen).to(dtype)) for p, t in pattern]
    groups = [hs[:4], hs[4:]]  # as a stage takes them
    expected = [u for g in groups for u in rows.row_units(stage, g) if len(u) > 1]  # probes run here
    passes: list[int] = []  # the row count of every pass of several chunks through a layer
    real = DecoderLayer.forward_rows
    monkeypatch.setattr(
        DecoderLayer, "forward_rows",
        lambda layer, x, spans: (len(spans) > 1 and passes.append(x.shape[1])) or real(layer, x, spans),
    )
    stage.open_session("one", 64)
    one = []
    for p, h in hs:
        stage.rollback("one", p)
        one.append(stage.forward("one", h))
    stage.open_session("seq", 64)
    seq = [out for g in groups for out in stage.forward_seq("seq", g)]
    assert all(torch.equal(a, b) for a, b in zip(one, seq, strict=True))
    a, b = stage._cache("one"), stage._cache("seq")
    assert a.length == b.length == 37
    for i in a._k:
        assert torch.equal(a._k[i][:, :, :37], b._k[i][:, :, :37]) and torch.equal(a._v[i][:, :, :37], b._v[i][:, :, :37])
    assert len(passes) == len(expected) * len(stage.layers)  # one pass per layer per merged unit
    merged = [[sum(g[k][1].shape[0] for k in u) for u in rows.row_units(stage, g) if len(u) > 1] for g in groups]
    assert passes == [n for m in merged for _ in stage.layers for n in m]  # layer by layer, each group in turn
    assert bool(passes) == any(stage.rows_exact_memo.values())


def test_layers_that_are_not_hand_written_are_never_merged(ck: Checkpoint) -> None:
    stage = Stage.load(ck.args, ck.source, 0, 4, dtype=torch.bfloat16, runtime="transformers")
    assert not any(rows.rows_invariant(stage, n) for n in range(2, rows.MAX_ROWS + 1))


def test_a_verdict_is_proven_once_per_layer_signature(ck: Checkpoint, monkeypatch: Any) -> None:
    """Blocks of one model share the verdict (same module types, shapes, dtype, threads); another
    dtype is another signature and is proven on its own."""
    runs: list[Any] = []
    real = rows._prove
    monkeypatch.setattr(rows, "_PROVEN", {})
    monkeypatch.setattr(rows, "_prove", lambda stage, layer: runs.append(stage.dtype) or real(stage, layer))
    a = Stage.load(ck.args, ck.source, 0, 2, dtype=torch.bfloat16)
    b = Stage.load(ck.args, ck.source, 2, 4, dtype=torch.bfloat16)
    c = Stage.load(ck.args, ck.source, 0, 4, dtype=torch.float32)
    assert rows.prove(a) == rows.prove(b) and runs == [torch.bfloat16]
    rows.prove(c)
    assert runs == [torch.bfloat16, torch.float32]
