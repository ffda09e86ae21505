"""Draft models by name: what a user types after ``--draft``, what each costs, and how it loads.

A draft *spec* is one of

- ``none`` and ``ngram``: no model (``ngram`` is prompt lookup, drafters.NgramDrafter);
- ``self``: the target minus its middle fifth of layers (drafters.self_draft_layers), sharing the
  target's embedding and head: no extra head, 0.8 of the target's layer bytes;
- ``int8`` / ``int4``: a compact copy of the target, every layer (swarm.model.quant), sharing the
  target's embedding, with an int8 copy of its LM head (drafters.CompactHead): 0.5 / 0.31 of the
  layer bytes, plus half the head's;
- a checkpoint PATH (a directory or ``.gguf``) of a smaller model with the target's tokenizer
  (check_vocabularies): its own head and layers, held in the serving dtype;
- ``auto``: let the coordinator choose per request by measured cost (swarm.node.compute.drafting); with
  ``auto:SPEC`` naming the model it may choose (``auto`` alone: ``int4``).

Vocabularies (``check_vocabularies``): the draft's tokenizer must map every id to the same token
as the target's, the same number of tokens; the two heads may differ in *padding rows* past the
tokenizer's last id (Qwen2.5-0.5B has 151,936 rows for a 152,064-row 72B: both over 151,665
tokens), and the draft then gives the target's extra ids probability 0. Anything else is refused,
naming the first id whose tokens differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.errors import ConfigError, UsageError
from swarm.model.config import ModelArgs
from swarm.model.drafters import CompactHead, DraftModel, self_draft_layers, self_draft_model
from swarm.model.quant import layer_bytes, linear_bytes
from swarm.model.stage import Head, Stage
from swarm.model.tokenizer import Tokenizer
from swarm.model.weights import Checkpoint, open_checkpoint

NO_MODEL = ("none", "ngram")
DERIVED = ("self", "int8", "int4")  # drafts built from the target's own weights
AUTO_MODEL = "int4"  # the model ``auto`` may choose unless told: measured best offline draft (README)


@dataclass(frozen=True)
class DraftSpec:
    """A parsed ``--draft``: ``kind`` none | ngram | self | int8 | int4 | path, ``auto`` whether
    the coordinator chooses per request (then ``kind`` is the model it may choose)."""

    kind: str
    path: Path | None = None
    auto: bool = False

    @property
    def model(self) -> bool:
        """Whether a draft model is loaded for it."""
        return self.kind not in NO_MODEL

    @property
    def label(self) -> str:
        """The model's name in receipts and adverts: self, int8, int4, or the checkpoint's name."""
        return self.path.name if self.path is not None else self.kind

    def __str__(self) -> str:
        base = str(self.path) if self.path is not None else self.kind
        return f"auto:{base}" if self.auto else base


def parse_draft(text: str, *, where: str = "--draft") -> DraftSpec:
    """A DraftSpec from what a user typed; a path must exist (UsageError naming it otherwise)."""
    text = text.strip()
    if text == "auto":
        return DraftSpec(AUTO_MODEL, auto=True)
    if text.startswith("auto:"):
        inner = parse_draft(text[5:], where=where)
        if inner.auto or not inner.model:
            raise UsageError(f"{where} {text!r}: auto:SPEC names a draft model (self, int8, int4 or a PATH)")
        return DraftSpec(inner.kind, inner.path, auto=True)
    if text in NO_MODEL or text in DERIVED:
        return DraftSpec(text)
    path = Path(text).expanduser()
    if not path.exists():
        raise UsageError(
            f"{where} {text!r}: not none, ngram, self, int8, int4, auto or an existing checkpoint path"
        )
    return DraftSpec("path", path)


def draft_weight_bytes(spec: DraftSpec, target: ModelArgs, dtype_bytes: int) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) the draft adds to the coordinator, from configs only
    (the planner's budget, before anything is loaded)."""
    if not spec.model:
        return 0, 0
    if spec.kind == "self":
        n = sum(b - a for a, b in self_draft_layers(target.n_layers))
        return n * target.layer_bytes(dtype_bytes), n * target.kv_bytes_per_token_per_layer(dtype_bytes)
    if spec.kind in ("int8", "int4"):
        head = linear_bytes(target.vocab_size, target.dim, "int8", dtype_bytes)  # CompactHead's copy
        return (target.n_layers * layer_bytes(target, spec.kind, dtype_bytes) + head,
                target.n_layers * target.kv_bytes_per_token_per_layer(dtype_bytes))  # fmt: skip
    assert spec.path is not None
    args = open_checkpoint(spec.path).args
    return (args.n_layers * args.layer_bytes(dtype_bytes) + args.head_bytes(dtype_bytes),
            args.n_layers * args.kv_bytes_per_token_per_layer(dtype_bytes))  # fmt: skip


def load_draft_model(
    spec: DraftSpec,
    *,
    head: Head,
    target: Checkpoint,
    dtype: torch.dtype,
    device: str | torch.device,
    target_tokenizer: Tokenizer | None = None,
) -> DraftModel:
    """Load the draft ``spec`` names next to the target's ``head`` (on its device)."""
    if not spec.model:
        raise UsageError(f"draft {spec}: not a draft model")
    if spec.kind == "self":
        return self_draft_model(head, target, dtype=dtype)
    if spec.kind in ("int8", "int4"):
        stage = Stage.load(target.args, target.source, 0, target.args.n_layers, dtype=dtype, device=device,
                           quant=spec.kind)  # fmt: skip
        return DraftModel(CompactHead(head, "int8"), [stage], name=spec.kind, shared_head=True)
    assert spec.path is not None
    ckpt = open_checkpoint(spec.path)
    check_vocabularies(target_tokenizer, _tokenizer_of(spec.path), target_rows=target.args.vocab_size,
                       draft_rows=ckpt.args.vocab_size, draft_name=str(spec.path))  # fmt: skip
    dhead = Head.load(ckpt.args, ckpt.source, dtype=dtype, device=device)
    stage = Stage.load(ckpt.args, ckpt.source, 0, ckpt.args.n_layers, dtype=dtype, device=device)
    return DraftModel(dhead, [stage], name=spec.path.name, vocab=target.args.vocab_size)


def _tokenizer_of(path: Path) -> Tokenizer | None:
    """A checkpoint's tokenizer: its tokenizer.json, or a GGUF's own; None if it has neither."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Tokenizer.load(path)
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None


def check_vocabularies(
    target: Tokenizer | None,
    draft: Tokenizer | None,
    *,
    target_rows: int,
    draft_rows: int,
    draft_name: str = "the draft",
) -> None:
    """ConfigError unless the draft shares the target's tokenizer (see the module doc). Two
    checkpoints without tokenizers (prompts given as ids) need heads of the same size."""
    if target is None and draft is None:
        if target_rows != draft_rows:
            raise ConfigError(
                f"draft {draft_name} has a vocabulary of {draft_rows} tokens but the target has {target_rows} "
                "(neither has a tokenizer.json to compare): a draft must share the target's tokenizer"
            )
        return
    if target is None or draft is None:
        which = "the target" if target is None else draft_name
        raise ConfigError(
            f"draft {draft_name}: {which} has no tokenizer.json, so the vocabularies cannot be compared; "
            "a draft must share the target's tokenizer"
        )
    t, d = _by_id(target), _by_id(draft)
    for i in range(max(len(t), len(d))):
        a = t[i] if i < len(t) else None
        b = d[i] if i < len(d) else None
        if a != b:
            show = lambda tok: "no token" if tok is None else repr(tok)  # noqa: E731
            raise ConfigError(
                f"draft {draft_name}: token id {i} is {show(b)} in the draft's vocabulary but {show(a)} in "
                "the target's: a draft must share the target's tokenizer"
            )
    n = len(t)
    for rows, who in ((draft_rows, draft_name), (target_rows, "the target")):
        if rows < n:
            raise ConfigError(
                f"draft {draft_name}: {who}'s LM head has {rows} rows but the tokenizer has {n} tokens"
            )


def _by_id(tok: Tokenizer) -> list[str | None]:
    vocab = tok.vocab()
    out: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        out[i] = token
    return out
