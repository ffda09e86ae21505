"""Drafters: cheap guesses of the next tokens, verified losslessly by speculative.py.

- ``NgramDrafter``: prompt lookup. Finds the most recent earlier occurrence of the context's
  last n tokens (longest n first) and proposes what followed it. No model; deterministic.
- ``DraftModel``: a smaller model sharing the tokenizer: its own Head (or the target's) and a
  list of Stages (layer ranges of its checkpoint, possibly skipping layers, possibly compact
  int8/int4 copies). Weights only; each generation drafts through its own ``ModelDrafter``.
- ``ModelDrafter``: one generation's drafting with a DraftModel, autoregressive, with its own KV
  cache session. The cache is reused across calls by the longest common prefix of the tokens it
  has run and the new context: drafting ahead on the drafts of chunks still in flight only runs
  the new tokens, and a rejection rolls it back to the common prefix (O(1)).

Determinism: a drafter's output depends on the shapes of the forwards it ran (bf16 rounding), so
``prepare(prompt)`` runs the prompt but its last token as one forward and every later token runs
by itself. The draft's logits at a position are then a function of the tokens before it alone,
whatever was drafted, rolled back or drafted ahead meanwhile (``draft_ahead``: a ring's coordinator
drafts the next chunk while the ring verifies), so the drafts are the same on a ring's coordinator
and in ``shard-swarm run``.

Vocabularies: the draft proposes ids below ``min(draft rows, target rows)`` (``vocab``); rows of
a bigger head are padding rows no tokenizer token maps to (draftload.py checks the tokenizers),
and a draft with fewer rows gives the target's extra (padding) ids probability 0.

For a model with no smaller sibling (the bundled one) ``self_drafter`` builds a layer-skipped copy
of the target (``self_draft_layers``): the same weights and head, fewer layers.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn

from swarm.errors import UsageError
from swarm.model.config import ModelArgs
from swarm.model.quant import quantize_block
from swarm.model.sampling import (
    STREAM_DRAFT,
    SamplingParams,
    draw,
    position_generator,
    target_probs,
)
from swarm.model.speculative import Draft
from swarm.model.stage import Head, Stage
from swarm.model.weights import Checkpoint, open_checkpoint

_draft_sessions = itertools.count()


class Drafter(Protocol):
    """``propose`` returns at most ``k`` tokens continuing ``context`` (possibly fewer or none)
    and, when the params sample, the distributions (k, V) they were drawn from, or None for a
    deterministic draft."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams) -> Draft: ...


class NgramDrafter:
    """Prompt-lookup drafting: match the context's suffix earlier in the context."""

    cheap = True  # microseconds per proposal: a ring's coordinator runs it on its event loop

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> None:
        if not (1 <= min_ngram <= max_ngram):
            raise UsageError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(self, context: Sequence[int], k: int, params: SamplingParams) -> Draft:
        ctx = list(context[-self.window:])
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            suffix = ctx[n_ctx - n:]
            # The most recent earlier occurrence (its continuation must exist).
            for start in range(n_ctx - n - 1, -1, -1):
                if ctx[start:start + n] == suffix:
                    # Copy what followed; past the end of the context keep copying from the
                    # proposal itself, so a loop of period p is continued for all k tokens.
                    ext = list(ctx)
                    for i in range(k):
                        ext.append(ext[start + n + i])
                    return Draft(ext[n_ctx:], None)
        return Draft([], None)


class DraftModel:
    """A draft model's weights on one device: a Head and Stages (see the module doc)."""

    def __init__(self, head: Head, stages: Sequence[Stage], *, name: str = "model",
                 vocab: int | None = None, shared_head: bool = False) -> None:
        if not stages:
            raise UsageError("a model drafter needs at least one stage")
        self.head, self.stages, self.name = head, list(stages), name
        self.vocab = min(head.args.vocab_size, vocab or head.args.vocab_size)  # ids it may propose
        self.target_vocab = vocab or head.args.vocab_size  # the size of the distributions it returns
        self.shared_head = shared_head  # the target's own Head (self-skip, compact copies)

    @property
    def args(self) -> ModelArgs:
        return self.head.args

    @property
    def n_layers(self) -> int:
        return sum(st.end - st.start for st in self.stages)

    def nbytes(self) -> int:
        """Bytes of weights this draft adds to its host (a shared head is the target's)."""
        seen: set[int] = set()
        total = 0
        modules: list[nn.Module] = list(self.stages)
        if isinstance(self.head, CompactHead):
            modules.append(self.head.lm_head)  # its own compact copy; embedding and norm are the target's
        elif not self.shared_head:
            modules.append(self.head)
        for m in modules:
            for t in itertools.chain(m.parameters(), m.buffers()):
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total

    def kv_bytes_per_token(self) -> int:
        nbytes = torch.empty(0, dtype=self.stages[0].dtype).element_size()
        return self.n_layers * self.args.kv_bytes_per_token_per_layer(nbytes)

    def drafter(self, max_len: int) -> ModelDrafter:
        """A new generation's drafter (its own KV cache of ``max_len`` positions)."""
        return ModelDrafter(self.head, self.stages, max_len=max_len, name=self.name, vocab=self.target_vocab,
                            model=self)  # fmt: skip

    def measure_ms(self, repeats: int = 5) -> float:
        """Median ms of drafting one token at a short context (a forward and the head)."""
        d = self.drafter(16 + repeats)
        try:
            with torch.inference_mode():
                d._forward(list(range(8)))
                times = []
                for i in range(repeats):
                    t0 = time.perf_counter()
                    d._forward([i + 1])
                    times.append(time.perf_counter() - t0)
        finally:
            d.close()
        return 1000.0 * statistics.median(times)


class ModelDrafter:
    """A small model's autoregressive guesses (greedy, or sampled with position-keyed seeds)."""

    def __init__(self, head: Head, stages: Sequence[Stage], *, max_len: int,
                 name: str = "model", vocab: int | None = None, model: DraftModel | None = None) -> None:
        if not stages:
            raise UsageError("a model drafter needs at least one stage")
        self.head, self.stages, self.max_len, self.name = head, list(stages), max_len, name
        self.model = model
        self.target_vocab = vocab or head.args.vocab_size
        self.vocab = min(head.args.vocab_size, self.target_vocab)
        self.session: Hashable = ("draft", next(_draft_sessions))
        for st in self.stages:
            st.open_session(self.session, max_len)
        self._ran: list[int] = []  # tokens whose KV is in the cache, in order
        self._logits: dict[int, torch.Tensor] = {}  # position -> the draft's logits for the token there
        self._lock = threading.Lock()  # prepare() may run in another thread than propose()
        self.forwards = 0  # forward passes run (tests: what a rollback or a re-plan costs)
        self.tokens_run = 0  # tokens those passes ran
        self.busy_s = 0.0  # time spent in them
        self.ahead_hits = 0  # proposed tokens that were drafted ahead, before they were asked for
        self.closed = False

    def relative_cost(self, target: ModelArgs) -> float:
        """Weights read per drafted token / per target token: the policy's ``draft_cost``."""
        mine = self.head.args
        layers = sum(st.end - st.start for st in self.stages)
        ours = layers * mine.layer_bytes(2) + mine.head_bytes(2)
        return ours / (target.n_layers * target.layer_bytes(2) + target.head_bytes(2))

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        layers: Sequence[tuple[int, int]] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        max_len: int = 4096,
    ) -> ModelDrafter:
        """A drafter from a checkpoint on ``device``; ``layers`` lists the [start, end) ranges to
        run (default: every layer)."""
        ckpt = open_checkpoint(path)
        ranges = list(layers) if layers is not None else [(0, ckpt.args.n_layers)]
        head = Head.load(ckpt.args, ckpt.source, dtype=dtype, device=device)
        stages = [Stage.load(ckpt.args, ckpt.source, a, b, dtype=dtype, device=device) for a, b in ranges]
        max_len = min(max_len, ckpt.args.max_seq_len)
        return cls(head, stages, max_len=max_len, name=Path(path).name)

    def close(self) -> None:
        """Free this generation's draft KV cache (idempotent). Never waits: if a forward is
        running in another thread (drafting ahead), that thread frees it when the forward ends."""
        self.closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._free()
            finally:
                self._lock.release()

    def _free(self) -> None:
        if self.closed:
            for st in self.stages:
                st.close_session(self.session)
            self._logits.clear()

    @property
    def cached_tokens(self) -> int:
        return len(self._ran)

    def _forward(self, ids: Sequence[int], *, timed: bool = True) -> torch.Tensor:
        """Run ``ids`` after the cache; return the logits (V,) of the last one. ``timed``: count
        it in ``forwards`` and ``busy_s`` (a proposal's, not the prompt's)."""
        t0 = time.perf_counter()
        h = self.head.embed(torch.tensor(list(ids), dtype=torch.long))  # (T, D)
        for st in self.stages:
            h = st.forward(self.session, h)  # (T, D)
        self._ran.extend(ids)
        out = self.head.logits(h[-1:])[0]  # (V,)
        self._logits[len(self._ran)] = out
        self.tokens_run += len(ids)
        if timed:
            self.forwards += 1
            self.busy_s += time.perf_counter() - t0
        return out

    def _truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens' KV; forget the predictions that depended on the rest."""
        if n < len(self._ran):
            for st in self.stages:
                st.rollback(self.session, n)
            del self._ran[n:]
        for p in [p for p in self._logits if p > n]:
            del self._logits[p]

    def _rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the ids it may propose (padding rows of a bigger head cut)."""
        return logits[: self.vocab] if logits.shape[0] > self.vocab else logits

    def _probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The draft distribution over the target's ids (ids the draft cannot propose get 0)."""
        q = target_probs(self._rows(logits), params)  # (vocab,)
        if q.shape[0] < self.target_vocab:
            q = torch.cat([q, q.new_zeros(self.target_vocab - q.shape[0])])
        return q  # (V_target,)

    def prepare(self, prompt: Sequence[int]) -> None:
        """Run the prompt, but its last token, into the cache (once; a no-op after that)."""
        with self._lock:
            if self._ran or len(prompt) < 2 or self.closed:
                return
            with torch.inference_mode():
                self._forward(list(prompt[: min(len(prompt), self.max_len) - 1]), timed=False)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams) -> Draft:
        with self._lock:
            return self._draft(context, k, params)

    def draft_ahead(self, context: Sequence[int], k: int, params: SamplingParams,
                    stop: threading.Event | None = None) -> None:
        """Draft ``k`` tokens after ``context`` now, while the ring verifies: the next
        ``propose`` on ``context`` (or on ``context`` plus a prefix of these drafts, the target's
        verdicts) finds them computed. ``stop`` ends it between two forwards. A no-op before
        ``prepare`` (the prompt's forward must come first, the same in every run)."""
        with self._lock:
            try:
                if self._ran:
                    self._draft(context, k, params, stop)
            finally:
                self._free()  # closed meanwhile: this thread frees the cache

    def _draft(self, context: Sequence[int], k: int, params: SamplingParams,
               stop: threading.Event | None = None) -> Draft:
        """Propose ``k`` tokens after ``context``: every token after the prompt runs by itself (one
        forward per token), so the logits at a position depend only on the tokens before it, and a
        token drafted ahead, or run before a rollback, is reused exactly as it would be recomputed."""
        if k <= 0 or not context or self.closed:
            return Draft([], None)
        k = min(k, self.max_len - len(context))
        if k <= 0:
            return Draft([], None)
        lcp = 0
        limit = min(len(self._ran), len(context))
        while lcp < limit and self._ran[lcp] == context[lcp]:
            lcp += 1
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        with torch.inference_mode():
            if not self._ran and len(context) > 1:  # used without prepare(): the first context but its last token
                self._forward(list(context[:-1]), timed=False)
                lcp = len(context) - 1
            ready = 0  # tokens of this proposal drafted before it was asked for (ahead of time)
            if lcp < len(context) or len(context) not in self._logits:
                self._truncate(min(lcp, len(context) - 1))
                for tok in context[len(self._ran):]:
                    if stop is not None and stop.is_set():
                        return Draft([], None)
                    self._forward([tok])
            elif stop is None:
                ready += 1
            for i in range(k):
                pos = len(context) + i
                if i:  # the drafted token before this one: run it, unless it was (ahead of time)
                    prev = tokens[-1]
                    if len(self._ran) > pos - 1 and self._ran[pos - 1] == prev and pos in self._logits:
                        ready += stop is None and ready == i
                    else:
                        if stop is not None and stop.is_set():
                            break
                        self._truncate(pos - 1)
                        self._forward([prev])
                logits = self._logits[pos]
                if params.greedy:
                    tok = int(self._rows(logits).argmax().item())
                else:
                    q = self._probs(logits, params)  # (V,)
                    tok = draw(q, position_generator(params.seed, pos, STREAM_DRAFT))
                    probs.append(q)
                tokens.append(tok)
        for p in [p for p in self._logits if p < len(context)]:
            del self._logits[p]  # before this context's end: never asked for again
        self.ahead_hits += ready
        return Draft(tokens, torch.stack(probs) if probs else None)


class CompactHead(Head):
    """A draft's head: the target's embedding and final norm (shared) with an int8 copy of its
    LM head. Its logits only choose drafts; the target verifies with its own head, so the copy
    changes acceptance, never the output. Measured on the bundled model with an int4 draft: 19 ms
    per drafted token against 22-25 ms with the bf16 head, acceptance alike (0.92-0.97); an int4
    head was slower (39 ms) and accepted less (0.79-0.90)."""

    def __init__(self, head: Head, quant: str = "int8") -> None:
        nn.Module.__init__(self)  # not Head.__init__: there is no dense lm_head weight to tie
        w = cast(torch.Tensor, head.lm_head.weight)
        box = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta"))
        box[0].weight = nn.Parameter(w.detach(), requires_grad=False)
        quantize_block(box, quant, dtype=w.dtype)
        self.args, self.embed_tokens, self.norm = head.args, head.embed_tokens, head.norm
        self.lm_head, self.softcap, self.tied, self.dtype = box[0], head.softcap, False, w.dtype

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        dev = cast(torch.Tensor, self.embed_tokens.weight).device
        out = self.lm_head(self.norm(h.to(device=dev, dtype=self.dtype)[None]))[0]  # (T, V)
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out.float()


def self_draft_layers(n_layers: int) -> list[tuple[int, int]]:
    """The layers a "self" draft keeps: the target minus its middle fifth.

    Measured on the bundled SmolLM2-135M (30 layers, greedy, chat prompts, teacher-forced): keeping
    [0, 12) + [18, 30) agrees with the target on 70% of tokens (1.6 accepted per round at K = 4);
    truncating to the first 24 layers agrees on 30%, skipping every other middle layer on 6-13%.
    """
    if n_layers < 5:
        return [(0, n_layers)]
    lo, hi = round(0.4 * n_layers), round(0.6 * n_layers)
    return [(0, lo), (hi, n_layers)]


def self_drafter(head: Head, ckpt: Checkpoint, *, dtype: torch.dtype,
                 max_len: int) -> ModelDrafter:
    """A layer-skipped copy of a target sharing its Head, on the Head's device (see
    ``self_draft_layers``)."""
    return self_draft_model(head, ckpt, dtype=dtype).drafter(max_len)


def self_draft_model(head: Head, ckpt: Checkpoint, *, dtype: torch.dtype, quant: str = "none") -> DraftModel:
    """The weights of ``self_drafter`` (``quant``: the kept layers held as int8/int4)."""
    device = cast(torch.Tensor, head.embed_tokens.weight).device
    stages = [Stage.load(ckpt.args, ckpt.source, a, b, dtype=dtype, device=device, quant=quant)
              for a, b in self_draft_layers(ckpt.args.n_layers)]
    return DraftModel(head, stages, name="self", shared_head=True)
