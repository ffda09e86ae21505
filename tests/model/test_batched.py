"""forward_many: several sessions through one stage in one call, each as if it ran alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.errors import ModelError
from swarm.model import batched
from swarm.model.generate import LocalModel
from swarm.model.stage import Stage
from swarm.model.weights import open_checkpoint
from swarm.testing.checkpoints import TinySpec, write_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), TinySpec(n_layers=3, n_heads=4, n_kv_heads=2), seed=5)


def _steps() -> list[list[tuple[str, int]]]:
    """Rounds of (session, tokens): ragged lengths, prefill from 0, chunks after a cache, single
    decode tokens, sessions joining late and leaving early."""
    return [
        [("a", 7), ("b", 1), ("c", 12)],
        [("a", 1), ("b", 4), ("c", 1)],
        [("a", 3), ("c", 1), ("d", 5)],
        [("b", 1), ("d", 1)],
        [("a", 1), ("b", 2), ("c", 6), ("d", 1)],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_rows_equal_each_session_alone(ckpt: Path, dtype: torch.dtype) -> None:
    alone = LocalModel.load(ckpt, stages=1, dtype=dtype).stages[0]
    together = LocalModel.load(ckpt, stages=1, dtype=dtype).stages[0]
    gen = torch.Generator().manual_seed(0)
    for s in "abcd":
        alone.open_session(s, 64)
        together.open_session(s, 64)
    for step in _steps():
        items = [(s, torch.randn(t, alone.args.dim, generator=gen).to(dtype)) for s, t in step]
        want = [alone.forward(s, h) for s, h in items]
        got = batched.forward_many(together, items)
        for (s, _), w, g in zip(items, want, got, strict=True):
            assert g.shape == w.shape and together.session_len(s) == alone.session_len(s)
            # last-bit differences only (a GEMM's blocking depends on its row count)
            tol = 1e-5 if dtype == torch.float32 else 5e-2
            assert torch.allclose(g.float(), w.float(), atol=tol, rtol=tol), (s, (g.float() - w.float()).abs().max())


def test_one_after_another_mode_is_bit_exact_and_duplicates_are_refused(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched, "BATCHED", False)
    alone = LocalModel.load(ckpt, stages=1, dtype=torch.float32).stages[0]
    together = LocalModel.load(ckpt, stages=1, dtype=torch.float32).stages[0]
    for s in "ab":
        alone.open_session(s, 16)
        together.open_session(s, 16)
    items = [("a", torch.randn(3, alone.args.dim)), ("b", torch.randn(1, alone.args.dim))]
    for (s, h), g in zip(items, batched.forward_many(together, items), strict=True):
        assert torch.equal(g, alone.forward(s, h))
    with pytest.raises(ModelError, match="twice"):
        batched.forward_many(together, [("a", items[0][1]), ("a", items[0][1])])
    with pytest.raises(ModelError, match="twice"):
        together.forward_batch([("b", items[1][1]), ("b", items[1][1])])


def test_transformers_layers_run_one_session_at_a_time(ckpt: Path) -> None:
    """transformers' layers take one chunk a call: forward_batch refuses them, and forward_many
    runs their sessions one after another, bit for bit each alone."""
    ck = open_checkpoint(ckpt)
    alone, together = (Stage.load(ck.args, ck.source, 0, ck.args.n_layers, dtype=torch.float32, runtime="transformers")
                       for _ in range(2))
    assert together.runtime == "transformers"
    for s in "ab":
        alone.open_session(s, 16)
        together.open_session(s, 16)
    items = [("a", torch.randn(2, alone.args.dim)), ("b", torch.randn(1, alone.args.dim))]
    with pytest.raises(ModelError, match="transformers' layers"):
        together.forward_batch(items)
    assert together.session_len("a") == 0  # refused before any cache moved
    for (s, h), g in zip(items, batched.forward_many(together, items), strict=True):
        assert torch.equal(g, alone.forward(s, h))
