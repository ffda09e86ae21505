"""Stage and Head: chunking, rollback, independent sessions, reading only owned tensors, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.errors import ModelError
from swarm.model import llama_layers
from swarm.model.stage import Head, Stage
from swarm.model.weights import Checkpoint, open_checkpoint
from swarm.testing.checkpoints import TinySpec, tiny_config, write_checkpoint

torch.set_num_threads(1)
SPEC = TinySpec(family="llama", n_layers=4, n_heads=4, n_kv_heads=2)
IDS = [3, 17, 99, 4, 250, 8, 61, 7, 130, 42, 11, 200, 5, 77, 19, 1, 240, 66, 31, 90]


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return open_checkpoint(write_checkpoint(tmp_path_factory.mktemp("st"), SPEC, seed=11))


@pytest.fixture(scope="module")
def parts(ck: Checkpoint) -> tuple[Head, list[Stage]]:
    head = Head.load(ck.args, ck.source, dtype=torch.float32)
    stages = [Stage.load(ck.args, ck.source, a, b, dtype=torch.float32) for a, b in [(0, 1), (1, 4)]]
    return head, stages


def run(parts: tuple[Head, list[Stage]], session: Any, ids: list[int]) -> torch.Tensor:
    """Final hidden states (T, D) for ``ids`` appended to ``session`` as one chunk."""
    head, stages = parts
    h = head.embed(torch.tensor(ids))
    for s in stages:
        h = s(session, h)
    return h


def open_all(parts: tuple[Head, list[Stage]], session: Any, max_len: int = 64) -> None:
    for s in parts[1]:
        s.open_session(session, max_len)


def close_all(parts: tuple[Head, list[Stage]], session: Any) -> None:
    for s in parts[1]:
        s.close_session(session)


def test_chunked_prefill_verify_and_rollback_equal_token_by_token(parts: tuple[Head, list[Stage]]) -> None:
    head = parts[0]
    open_all(parts, "ref")
    ref = torch.cat([run(parts, "ref", [t]) for t in IDS])  # (20, D) one token at a time
    open_all(parts, "chunks")
    got = [run(parts, "chunks", IDS[:7])]  # prefill chunk from an empty cache
    got.append(run(parts, "chunks", IDS[7:10]))  # chunk appended after a cache
    # a verify chunk of 4 "drafted" tokens, of which only the first 1 is right
    drafted = [IDS[10], 0, 0, 0]
    verify = run(parts, "chunks", drafted)
    torch.testing.assert_close(verify[:1], ref[10:11], rtol=1e-5, atol=1e-5)
    for s in parts[1]:
        assert s.session_len("chunks") == 14
        s.rollback("chunks", 11)
    got.append(verify[:1])
    got.append(run(parts, "chunks", IDS[11:16]))  # another verify chunk after the rollback
    for t in IDS[16:]:
        got.append(run(parts, "chunks", [t]))
    chunked = torch.cat(got)
    torch.testing.assert_close(chunked, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.logits(chunked), head.logits(ref), rtol=1e-5, atol=1e-4)
    assert [s.session_len("chunks") for s in parts[1]] == [20, 20]
    close_all(parts, "ref")
    close_all(parts, "chunks")


def test_sessions_do_not_mix(parts: tuple[Head, list[Stage]]) -> None:
    a_ids, b_ids = IDS[:10], IDS[10:]
    open_all(parts, "a-alone")
    a_alone = torch.cat([run(parts, "a-alone", [t]) for t in a_ids])
    open_all(parts, "b-alone")
    b_alone = run(parts, "b-alone", b_ids)
    open_all(parts, 1)
    open_all(parts, (2, "x"))  # any hashable is a session key
    a_out, b_out = [], []
    b_out.append(run(parts, (2, "x"), b_ids[:4]))
    for i, t in enumerate(a_ids):
        a_out.append(run(parts, 1, [t]))
        if i == 3:
            b_out.append(run(parts, (2, "x"), b_ids[4:]))
        if i == 5:  # a rollback in one session leaves the other alone
            for s in parts[1]:
                s.rollback((2, "x"), 4)
            b_out.pop()
            b_out.append(run(parts, (2, "x"), b_ids[4:]))
    torch.testing.assert_close(torch.cat(a_out), a_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(b_out), b_alone, rtol=1e-5, atol=1e-5)
    assert set(parts[1][0].sessions()) >= {1, (2, "x")}
    for k in ("a-alone", "b-alone", 1, (2, "x")):
        close_all(parts, k)
    assert parts[1][0].sessions() == []


def test_session_errors(parts: tuple[Head, list[Stage]], ck: Checkpoint) -> None:
    s = parts[1][0]
    with pytest.raises(ModelError, match="no session 'ghost' open on stage \\[0, 1\\)"):
        s(("ghost"), torch.zeros(1, ck.args.dim))
    with pytest.raises(ModelError, match="no session"):
        s.rollback("ghost", 0)
    s.open_session("e", 4)
    with pytest.raises(ModelError, match="already open"):
        s.open_session("e", 4)
    with pytest.raises(ModelError, match="expects hidden states"):
        s("e", torch.zeros(2, ck.args.dim + 1))
    with pytest.raises(ModelError, match="expects hidden states"):
        s("e", torch.zeros(0, ck.args.dim))
    s("e", torch.zeros(3, ck.args.dim))
    with pytest.raises(ModelError, match="KV cache full"):
        s("e", torch.zeros(2, ck.args.dim))
    assert s.session_len("e") == 3  # a refused forward appends nothing
    with pytest.raises(ModelError, match="cannot roll back"):
        s.rollback("e", 4)
    s.close_session("e")
    s.close_session("e")  # idempotent
    with pytest.raises(ModelError, match="max_position_embeddings"):
        s.open_session("big", ck.args.max_seq_len + 1)


def test_invalid_layer_ranges(ck: Checkpoint) -> None:
    for a, b in [(-1, 2), (2, 2), (3, 2), (0, 5)]:
        with pytest.raises(ModelError, match="invalid layer range"):
            Stage.load(ck.args, ck.source, a, b)


class Recording:
    """A TensorSource wrapper that records which tensors were read."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.path, self.loaded = inner, inner.path, []  # type: ignore[var-annotated]

    def names(self) -> list[str]:
        return list(self.inner.names())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.inner.shape(name))

    def load(self, name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
        self.loaded.append(name)
        return self.inner.load(name, dtype, device)


def test_stage_reads_only_its_layers_and_reports_progress(ck: Checkpoint) -> None:
    src = Recording(ck.source)
    seen: list[tuple[int, int]] = []
    stage = Stage.load(ck.args, src, 1, 3, dtype=torch.bfloat16, device=torch.device("cpu"),
                       progress=lambda d, t: seen.append((d, t)))
    assert src.loaded and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in src.loaded)
    assert len(src.loaded) == 2 * 9 == len(set(src.loaded))
    assert seen == [(1, 2), (2, 2)]  # one step per layer
    params = list(stage.parameters())
    assert params and all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params)
    assert not any(p.requires_grad for p in params)


def test_head_reads_only_head_tensors_and_ties(ck: Checkpoint, tmp_path: Path) -> None:
    src = Recording(ck.source)
    head = Head.load(ck.args, src, dtype=torch.float32)
    assert sorted(src.loaded) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert not head.tied
    smol = open_checkpoint(write_checkpoint(tmp_path / "smol", TinySpec(family="smollm", n_layers=1)))
    src2 = Recording(smol.source)
    tied = Head.load(smol.args, src2, dtype=torch.float32)
    assert sorted(src2.loaded) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert tied.tied and tied.lm_head.weight is tied.embed_tokens.weight
    ids = torch.tensor([3, 5])
    logits = tied.logits(tied.embed(ids))
    assert logits.shape == (2, smol.args.vocab_size) and logits.dtype == torch.float32
    with pytest.raises(ModelError, match="out of range"):
        tied.embed(torch.tensor([smol.args.vocab_size]))
    with pytest.raises(ModelError, match=r"shape \(T,\)"):
        tied.embed(torch.tensor([[1]]))


def test_bf16_logits_are_computed_in_bf16_then_upcast(ck: Checkpoint) -> None:
    head = Head.load(ck.args, ck.source, dtype=torch.bfloat16)
    h = head.embed(torch.tensor([1, 2, 3]))
    assert h.dtype == torch.bfloat16
    logits = head.logits(h)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, logits.to(torch.bfloat16).float())  # exactly bf16 values


def test_runtime_choice_follows_the_window(tmp_path: Path) -> None:
    """A window shorter than the context goes to transformers' layers (windowed masks), not refused."""
    spec = TinySpec(family="mistral", n_layers=1, extra={"sliding_window": 16})
    m = open_checkpoint(write_checkpoint(tmp_path / "mis", spec))
    s = Stage.load(m.args, m.source, 0, 1, dtype=torch.float32)
    assert s.runtime == "transformers" and m.args.sliding_window == 16
    s.open_session("long", 40)
    assert s("long", torch.randn(40, m.args.dim)).shape == (40, m.args.dim)
    full = open_checkpoint(write_checkpoint(tmp_path / "full", TinySpec(family="mistral", n_layers=1)))
    assert Stage(full.args, 0, 1).runtime == "handwritten"  # window == max_position_embeddings


def test_rope_matches_transformers_llama3() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config(TinySpec(family="llama", dim=128, n_heads=2, n_kv_heads=1))
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"]["original_max_position_embeddings"] = 8192
    hf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert scale == 1.0
    got = llama_layers.rope_inv_freq(llama_layers.ModelArgs.from_config(cfg))
    assert torch.equal(got, want.float())


@pytest.mark.parametrize("runtime", ["handwritten", "transformers"])
def test_forward_seq_is_chunk_by_chunk_bit_for_bit(ck: Checkpoint, runtime: str) -> None:
    """A replay group (Stage.forward_seq, layer by layer) computes exactly what its chunks one by
    one compute, in bf16, cache included: a prefill, one-token steps, and a verify chunk whose
    tail was rejected (the next chunk starts inside it)."""
    stage = Stage.load(ck.args, ck.source, 0, 4, dtype=torch.bfloat16, runtime=runtime)
    gen = torch.Generator().manual_seed(5)
    chunks = [(0, 7), (7, 1), (8, 1), (9, 4), (11, 1), (12, 3), (13, 1), (14, 1)]  # (pos, T)
    hs = [(p, torch.randn(t, ck.args.dim, generator=gen).to(torch.bfloat16)) for p, t in chunks]
    stage.open_session("one", 64)
    stage.open_session("seq", 64)
    one = []
    for p, h in hs:
        stage.rollback("one", p)
        one.append(stage.forward("one", h))
    seq = stage.forward_seq("seq", hs[:3]) + stage.forward_seq("seq", hs[3:])  # two groups, as a stage takes them
    assert all(torch.equal(a, b) for a, b in zip(one, seq, strict=True))
    a, b = stage._cache("one"), stage._cache("seq")
    assert a.length == b.length == 15
    for i in a._k:
        assert torch.equal(a._k[i][:, :, :15], b._k[i][:, :, :15]) and torch.equal(a._v[i][:, :, :15], b._v[i][:, :, :15])
    with pytest.raises(ModelError, match="positions held"):
        stage.forward_seq("seq", [(15, hs[1][1]), (17, hs[2][1])])  # a gap: 17 > 16
    assert stage.session_len("seq") == 15  # refused before anything ran
