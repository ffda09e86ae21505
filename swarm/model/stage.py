"""``Stage``: decoder layers [start, end) with per-session KV caches; ``Head``: the coordinator part.

Theory of operation
-------------------
A model is a chain ``Head.embed -> Stage[0, a) -> Stage[a, b) -> ... -> Stage[z, L) -> Head.logits``.
Every stage sees hidden states (T, D) and returns hidden states (T, D); it never sees token ids
or logits. A stage holds one :class:`KVCache` per session (a generation), so several generations
share one copy of the weights. Positions are implicit: a forward of T rows on a session whose
cache holds ``n`` entries computes positions ``n .. n+T-1`` and appends T entries. To undo a
rejected speculative tail, ``rollback(session, n)`` forgets everything from position ``n`` on.

Because every stage appends exactly the rows it is given, the caches of all stages of a session
stay at the same length as long as each stage sees the same chunks; the chain of stages computes
exactly what one stage holding all layers would (the golden tests check this against
transformers for every split).

Loading builds the modules on the ``meta`` device (no allocation, no random init) and then assigns
tensors read one by one from the :class:`~swarm.model.weights.TensorSource`, each checked against
the shape config.json implies. Only the stage's own tensors are ever read.

Threads: torch's intra-op thread count is a per-process setting; the process that owns stages
(CLI, node) calls ``torch.set_num_threads`` once. Nothing here changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from swarm.errors import ModelError
from swarm.model.config import ModelArgs
from swarm.model.kvcache import KVCache
from swarm.model.layers import DecoderLayer, RMSNorm, rope_inv_freq, rope_tables
from swarm.model.quant import check_quant, linear_paths, quantize_block
from swarm.model.weights import TensorSource, head_tensor_shapes, layer_tensor_shapes, load_checked

Progress = Callable[[int, int], None]


class Stage(nn.Module):
    """Decoder layers ``[start, end)`` of one model, with independent per-session KV caches."""

    def __init__(
        self,
        args: ModelArgs,
        start: int,
        end: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> None:
        """Build an *unloaded* stage on the meta device; use :meth:`load` to get a usable one."""
        super().__init__()
        if not (0 <= start < end <= args.n_layers):
            raise ModelError(
                f"invalid layer range [{start}, {end}) for a model of {args.n_layers} layers"
            )
        self.args = args
        self.start = start
        self.end = end
        self.dtype = dtype
        self.device = torch.device(device)
        with torch.device("meta"):
            self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(end - start))
        self._inv_freq = rope_inv_freq(args)
        self._cos = torch.empty(0, args.head_dim, dtype=dtype, device=self.device)
        self._sin = torch.empty(0, args.head_dim, dtype=dtype, device=self.device)
        self._sessions: dict[Hashable, KVCache] = {}
        self.quant = "none"  # set by load: how the linear layers are held (see swarm.model.quant)

    @classmethod
    def load(
        cls,
        args: ModelArgs,
        source: TensorSource,
        start: int,
        end: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        progress: Progress | None = None,
        quant: str = "none",
    ) -> Stage:
        """Read only the tensors of layers [start, end) from ``source`` (WeightsError on trouble).

        Layers are loaded one at a time and, with ``quant`` int8/int4, quantized before the next
        is read, so loading never holds more than one layer in ``dtype`` beyond the compact rest;
        a source with compact blocks (GGUF Q4_*) hands int4 groups over without a float copy.
        """
        check_quant(quant)
        stage = cls(args, start, end, dtype=dtype, device=device)
        stage.quant = quant
        per_layer = [layer_tensor_shapes(args, i) for i in range(start, end)]
        total, done = sum(len(s) for s in per_layer), 0
        compact = getattr(source, "compact", None) if quant != "none" else None
        for i, (layer, shapes) in enumerate(zip(stage.layers, per_layer, strict=True), start):
            prefix = f"model.layers.{i}."
            linears = set(linear_paths(layer))
            sd: dict[str, torch.Tensor] = {}
            given = {}
            for name, shape in shapes.items():
                key = name[len(prefix) :]
                packed = None
                if compact is not None and key.endswith(".weight") and key[: -len(".weight")] in linears:
                    packed = compact(name, quant)
                if packed is not None:
                    if tuple(packed.q.shape) != shape:
                        raise ModelError(f"{source.path}: tensor {name} has shape {list(packed.q.shape)} "
                                         f"but config.json implies {list(shape)}")  # fmt: skip
                    given[key[: -len(".weight")]] = packed
                    sd[key] = torch.empty(shape, dtype=dtype, device="meta")
                else:
                    sd[key] = load_checked(source, name, shape, dtype, stage.device)
                done += 1
                if progress is not None:
                    progress(done, total)
            layer.load_state_dict(sd, strict=True, assign=True)
            quantize_block(layer, quant, dtype=dtype, given=given)
        stage.requires_grad_(False)
        stage.eval()
        return stage

    # ------------------------------------------------------------------------- sessions
    def open_session(self, session: Hashable, max_len: int) -> None:
        """Allocate a KV cache for ``max_len`` positions (ModelError if the session exists)."""
        if session in self._sessions:
            raise ModelError(f"session {session!r} is already open on stage [{self.start}, {self.end})")
        if max_len > self.args.max_seq_len:
            raise ModelError(
                f"max_len {max_len} exceeds the model's max_position_embeddings {self.args.max_seq_len}"
            )
        self.args.check_context(max_len)
        self._sessions[session] = KVCache(
            self.end - self.start,
            self.args.n_kv_heads,
            max_len,
            self.args.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._ensure_rope(max_len)

    def close_session(self, session: Hashable) -> None:
        """Free a session's cache; closing an unknown session is a no-op (idempotent)."""
        self._sessions.pop(session, None)

    def session_len(self, session: Hashable) -> int:
        return self._cache(session).length

    def rollback(self, session: Hashable, length: int) -> None:
        """Forget positions >= ``length`` of ``session`` (O(1))."""
        self._cache(session).rollback(length)

    def sessions(self) -> list[Hashable]:
        return list(self._sessions)

    def _cache(self, session: Hashable) -> KVCache:
        c = self._sessions.get(session)
        if c is None:
            raise ModelError(f"no session {session!r} open on stage [{self.start}, {self.end})")
        return c

    def _ensure_rope(self, length: int) -> None:
        if self._cos.shape[0] < length:
            self._cos, self._sin = rope_tables(self._inv_freq, length, self.dtype, self.device)

    # ------------------------------------------------------------------------- compute
    @torch.inference_mode()
    def forward(self, session: Hashable, h: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """h (T, D) at positions session_len .. session_len+T-1 -> (T, D); appends T cache entries."""
        cache = self._cache(session)
        if h.dim() != 2 or h.shape[1] != self.args.dim or h.shape[0] == 0:
            raise ModelError(
                f"stage [{self.start}, {self.end}) expects hidden states (T, {self.args.dim}) "
                f"with T >= 1, got {tuple(h.shape)}"
            )
        T = h.shape[0]
        pos = cache.reserve(T)
        x = h.to(device=self.device, dtype=self.dtype).unsqueeze(0)  # (1, T, D)
        cos = self._cos[pos : pos + T]  # (T, hd)
        sin = self._sin[pos : pos + T]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], pos)
        cache.advance(T)
        return x[0]  # (T, D)


class Head(nn.Module):
    """Embedding, final norm and LM head: what the coordinator holds (no decoder layers)."""

    def __init__(
        self, args: ModelArgs, embedding: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor
    ) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Parameter(embedding, requires_grad=False)  # (V, D)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.norm.weight = nn.Parameter(norm, requires_grad=False)  # (D,)
        self.tied = lm_head is embedding
        self.lm_head = self.embed_tokens if self.tied else nn.Parameter(lm_head, requires_grad=False)

    @classmethod
    def load(
        cls,
        args: ModelArgs,
        source: TensorSource,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> Head:
        """Read only the embedding, final norm and LM head (a tied head reuses the embedding)."""
        shapes = head_tensor_shapes(args)
        emb = load_checked(source, "model.embed_tokens.weight", shapes["model.embed_tokens.weight"], dtype, device)
        norm = load_checked(source, "model.norm.weight", shapes["model.norm.weight"], dtype, device)
        if args.tie_word_embeddings:
            head = emb
        else:
            head = load_checked(source, "lm_head.weight", shapes["lm_head.weight"], dtype, device)
        return cls(args, emb, norm, head).eval()

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) int64 -> (T, D) in the model dtype."""
        if ids.dim() != 1:
            raise ModelError(f"embed expects token ids of shape (T,), got {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.args.vocab_size):
            raise ModelError(f"token id out of range [0, {self.args.vocab_size}) in {ids.tolist()}")
        return torch.nn.functional.embedding(ids.to(self.embed_tokens.device), self.embed_tokens)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (T, D) -> (T, V) float32, computed in the model dtype and then upcast (as HF does).

        Pass only the rows you need (e.g. ``h[-1:]`` after a prefill): that is both cheaper and
        what transformers' ``generate`` computes, so greedy ties resolve identically.
        """
        x = self.norm(h.to(device=self.embed_tokens.device, dtype=self.embed_tokens.dtype))
        return torch.nn.functional.linear(x, self.lm_head).float()  # (T, V)
