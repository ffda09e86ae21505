"""Tokenizer (``tokenizers`` library) and chat template (sandboxed jinja2), as HF ships them.

A checkpoint directory holds ``tokenizer.json`` (the whole tokenizer: model, pre-tokenizer,
decoder, added tokens) and ``tokenizer_config.json`` (special token names and the chat template,
which newer checkpoints may keep in ``chat_template.jinja`` instead). Chat templates are untrusted
code from a model repository: they are rendered in jinja2's ``ImmutableSandboxedEnvironment`` with
the same options and helpers transformers gives them (``trim_blocks``/``lstrip_blocks``,
``loopcontrols``, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps unicode), so the
rendered prompt is byte-identical to ``PreTrainedTokenizer.apply_chat_template``.

``build_bpe_tokenizer`` makes a tokenizer.json from the pieces a GGUF file stores (vocabulary,
merges, token types, the ``tokenizer.ggml.pre`` name of the pre-tokenizer regex).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from swarm.errors import TokenizerError

# --------------------------------------------------------------------------------------------
# Building a tokenizer.json from GGUF pieces

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre value -> family of pre-tokenizer (as llama.cpp's llama-vocab.cpp groups them)
_PRE_FAMILIES = {
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "phi-2": "gpt2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(pre: str, where: str) -> pre_tokenizers.PreTokenizer:
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise TokenizerError(
            f"{where}: tokenizer.ggml.pre = {pre!r} is not a pre-tokenizer we can rebuild "
            f"(known: {', '.join(sorted(_PRE_FAMILIES))})"
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = _LLAMA3_REGEX if family == "llama3" else _QWEN2_REGEX
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_bpe_tokenizer(
    *,
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    pre: str,
    add_bos: bool,
    bos_id: int | None,
    where: str,
) -> str:
    """tokenizer.json text for a byte-level BPE vocabulary as stored in a GGUF file."""
    if len(token_types) != len(tokens):
        raise TokenizerError(f"{where}: {len(tokens)} tokens but {len(token_types)} token types")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs: list[tuple[str, str]] = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"{where}: malformed merge {m!r} (expected 'left right')")
        pairs.append((a, b))
    try:
        tok = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        )
    except Exception as e:  # tokenizers raises plain Exception on bad vocab/merges
        raise TokenizerError(f"{where}: cannot build BPE tokenizer: {e}") from e
    tok.pre_tokenizer = _pre_tokenizer(pre, where)
    tok.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos and bos_id is not None and 0 <= bos_id < len(tokens):
        bos = tokens[bos_id]
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, bos_id)],
                ),
            ]
        )
    else:
        tok.post_processor = byte_level
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if t == _CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(token_types)
        if t == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok.to_str()


def _str_list(md: dict[str, Any], key: str, where: str) -> list[str]:
    v = md.get(key)
    if v is None:
        raise TokenizerError(f"{where}: GGUF metadata has no {key!r}")
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TokenizerError(f"{where}: GGUF metadata {key!r} is not a list of strings")
    return v


def tokenizer_files_from_gguf(
    md: dict[str, Any], *, where: str, max_len: int
) -> tuple[str, dict[str, Any], list[int]]:
    """(tokenizer.json text, tokenizer_config.json dict, extra eos ids) from GGUF metadata."""
    model = md.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise TokenizerError(
            f"{where}: tokenizer.ggml.model = {model!r}; only byte-level BPE ('gpt2') GGUF "
            "tokenizers can be converted"
        )
    tokens = _str_list(md, "tokenizer.ggml.tokens", where)
    merges = _str_list(md, "tokenizer.ggml.merges", where)
    types = md.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not isinstance(types, list) or not all(isinstance(t, int) for t in types):
        raise TokenizerError(
            f"{where}: GGUF metadata 'tokenizer.ggml.token_type' is not a list of ints"
        )
    pre = md.get("tokenizer.ggml.pre", "default")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))

    def token_id(key: str) -> int | None:
        v = md.get(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(tokens):
            raise TokenizerError(
                f"{where}: GGUF metadata 'tokenizer.ggml.{key}' = {v!r} is not a token id"
            )
        return v

    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    tok = build_bpe_tokenizer(
        tokens=tokens,
        merges=merges,
        token_types=types,
        pre=str(pre),
        add_bos=add_bos,
        bos_id=bos,
        where=where,
    )
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    for key, hf_key in (
        ("bos_token_id", "bos_token"),
        ("eos_token_id", "eos_token"),
        ("padding_token_id", "pad_token"),
        ("unknown_token_id", "unk_token"),
    ):
        i = token_id(key)
        if i is not None:
            tcfg[hf_key] = tokens[i]
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str):
        tcfg["chat_template"] = template
    extra = [
        i for k in ("eot_token_id", "eom_token_id") if (i := token_id(k)) is not None and i != eos
    ]
    return tok, tcfg, extra


# --------------------------------------------------------------------------------------------
# The chat template engine


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_content(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


# --------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """encode/decode with a ``tokenizers.Tokenizer``; chat template; special token ids."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        config: dict[str, Any],
        *,
        where: str,
        chat_template: str | None = None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tok
        self.where = where
        self.config = config
        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            content = _token_content(config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.bos_token_id: int | None = self._id_of("bos_token")
        self.pad_token_id: int | None = self._id_of("pad_token")
        eos = self._id_of("eos_token")
        ids = [eos] if eos is not None else []
        ids += [i for i in extra_eos_ids if i not in ids]
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.chat_template = (
            chat_template if chat_template is not None else self._template_from(config)
        )
        self._compiled: jinja2.Template | None = None

    def _id_of(self, key: str) -> int | None:
        content = self.special_tokens.get(key)
        if content is None:
            return None
        i = self._tok.token_to_id(content)
        if i is None:
            raise TokenizerError(f"{self.where}: {key} {content!r} is not in the vocabulary")
        return int(i)

    def _template_from(self, config: dict[str, Any]) -> str | None:
        t = config.get("chat_template")
        if t is None or isinstance(t, str):
            return t
        if isinstance(t, list):  # [{"name": ..., "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            if isinstance(named.get("default"), str):
                return str(named["default"])
        raise TokenizerError(f"{self.where}: chat_template has an unexpected form")

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        d = Path(path)
        tj, tc = d / "tokenizer.json", d / "tokenizer_config.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj}: missing (a checkpoint needs tokenizer.json)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            raise TokenizerError(f"{tj}: cannot load tokenizer: {e}") from e
        try:
            config = json.loads(tc.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TokenizerError(
                f"{tc}: missing (a checkpoint needs tokenizer_config.json)"
            ) from None
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{tc}: not valid JSON: {e}") from e
        if not isinstance(config, dict):
            raise TokenizerError(f"{tc}: expected a JSON object")
        template = None
        jinja_file = d / "chat_template.jinja"
        if "chat_template" not in config and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        extra: list[int] = []
        gen = d / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text(encoding="utf-8"))
                eid = g.get("eos_token_id") if isinstance(g, dict) else None
                extra = (
                    [eid]
                    if isinstance(eid, int)
                    else [i for i in (eid or []) if isinstance(i, int)]
                )
            except ValueError as err:
                raise TokenizerError(f"{gen}: not valid JSON: {err}") from err
        return cls(tok, config, where=str(d), chat_template=template, extra_eos_ids=extra)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one vocabulary entry spells: a text of N bytes is at least
        N / this many tokens (a sound lower bound, used to refuse a huge prompt unread)."""
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # encode_batch gives the same ids and lets go of the GIL while it works (encode holds
        # it: 11 s for a 1 MiB prompt, during which no other thread, the event loop included,
        # ran); so a big prompt tokenized in a worker thread never stalls the node
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers renders it (tokenize separately)."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.where}: the tokenizer has no chat_template")
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"{self.where}: chat_template does not compile: {e}") from e
        ctx: dict[str, Any] = dict(self.special_tokens)
        ctx.update(template_kwargs)
        try:
            return str(
                self._compiled.render(
                    messages=messages, add_generation_prompt=add_generation_prompt, **ctx
                )
            )
        except _TemplateRaised as e:
            raise TokenizerError(
                f"{self.where}: chat template refused the conversation: {e}"
            ) from e
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.where}: chat template failed: {e}") from e
