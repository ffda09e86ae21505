"""Tokenizer (``tokenizers`` library) and chat template (sandboxed jinja2), as HF ships them.

A checkpoint directory holds ``tokenizer.json`` (the whole tokenizer: model, pre-tokenizer,
decoder, added tokens) and ``tokenizer_config.json`` (special token names and the chat template,
which newer checkpoints may keep in ``chat_template.jinja`` instead). Chat templates are untrusted
code from a model repository: they are rendered in jinja2's ``ImmutableSandboxedEnvironment`` with
the same options and helpers transformers gives them (``trim_blocks``/``lstrip_blocks``,
``loopcontrols``, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps unicode), so the
rendered prompt is byte-identical to ``PreTrainedTokenizer.apply_chat_template``.

A ``.gguf`` file carries its tokenizer in its metadata (vocabulary, merges or scores, token types,
special ids, chat template): ``Tokenizer.from_gguf`` builds it with transformers' GGUF tokenizer
converter (tokenizer_from_gguf); ``Tokenizer.load`` takes either a directory or a ``.gguf``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors

from swarm.errors import TokenizerError

# --------------------------------------------------------------------------------------------
# A GGUF file's own tokenizer, through transformers' converter


def tokenizer_from_gguf(path: str | Path) -> tuple[tokenizers.Tokenizer, dict[str, Any], list[int]]:
    """(tokenizer, tokenizer_config.json dict, extra eos ids) of the tokenizer a GGUF file describes.

    transformers' GGUF tokenizer conversion does the work (byte-level BPE, SentencePiece/llama and
    Gemma vocabularies, each with its family's normalizer, pre-tokenizer and decoder); we add the
    BOS post-processor the file asks for (``tokenizer.ggml.add_bos_token``, as transformers'
    tokenizer classes do when they load) and llama.cpp's end-of-turn ids as extra eos ids. For a
    split GGUF, pass any split: the vocabulary lives in the first.
    """
    from swarm.model.families import gguf_tokenizer
    from swarm.model.gguf import split_files

    where = str(split_files(path)[0])
    try:
        tok, tdict, tcfg, md = gguf_tokenizer(where)
    except Exception as e:  # a foreign converter reading an untrusted file: any failure is the file's
        raise TokenizerError(f"{where}: cannot build the tokenizer from the GGUF metadata: {e!r}") from e
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config.update({k: v for k, v in tcfg.items() if v is not None})
    tokens = tdict.get("tokens", [])
    bos = tdict.get("bos_token_id")
    if config.get("add_bos_token") and isinstance(bos, int) and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)],
        )
    eos = tdict.get("eos_token_id")
    extra = []
    for key in ("eot_token_id", "eom_token_id"):
        i = md.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens) and i != eos and i not in extra:
            extra.append(i)
    return tok, config, extra


# What Hugging Face's tokenizers library holds for a BPE vocabulary once loaded, measured apart
# (tokenizers.Tokenizer.from_file, VmRSS after less before): Gemma 3's 262,144 tokens alone 52 MB,
# with its 514,906 merges 290 MB (~200 B a token, ~550 a merge); SmolLM2's 49,152 and 48,900: 31 MB
# (the formula says 37). A coordinator holds it beside the head (planner/budget.py).
BYTES_PER_TOKEN = 200
BYTES_PER_MERGE = 550
SPM_MERGES_PER_TOKEN = 1.96


def resident_bytes(model_dir: str | Path | None = None, *, gguf_metadata: dict[str, Any] | None = None) -> int:
    """What a checkpoint's tokenizer (a directory's tokenizer.json, or a GGUF file's metadata)
    holds once loaded, from its counts of tokens and merges; 0 where we read none."""
    if gguf_metadata is not None:
        tokens, merges = gguf_metadata.get("tokenizer.ggml.tokens"), gguf_metadata.get("tokenizer.ggml.merges")
        if not merges and gguf_metadata.get("tokenizer.ggml.model") == "llama" and tokens:
            # a SentencePiece vocabulary: transformers' conversion derives the merges from it
            # (Gemma 3's 262,144 tokens gave 514,906: SPM_MERGES_PER_TOKEN)
            return int((BYTES_PER_TOKEN + BYTES_PER_MERGE * SPM_MERGES_PER_TOKEN) * len(tokens))
    else:
        try:
            model = json.loads((Path(str(model_dir)) / "tokenizer.json").read_text(encoding="utf-8"))["model"]
            tokens, merges = model.get("vocab"), model.get("merges")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return 0
    return BYTES_PER_TOKEN * len(tokens or ()) + BYTES_PER_MERGE * len(merges or ())


def _keep(d: Path, tok: tokenizers.Tokenizer, config: dict[str, Any], eos: Sequence[int]) -> None:
    """Write a converted tokenizer as a directory ``from_dir`` reads (atomically; best effort)."""
    with contextlib.suppress(OSError):
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.tmp-", dir=d.parent))
        try:
            (tmp / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
            (tmp / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
            (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
            os.replace(tmp, d)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


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

    @classmethod
    def from_gguf(cls, path: str | Path, *, cache: Path | None = None) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata (the first file of a split set).

        With ``cache`` (a directory), the converted files are kept there under the GGUF's name,
        size and modification time, and read back next time: converting Gemma's 262,144-token
        vocabulary takes ~7 s here, reading the converted tokenizer.json well under one.
        """
        from swarm.model.gguf import split_files

        first = split_files(path)[0]
        kept = None
        if cache is not None:
            st = first.stat()
            kept = cache / f"{first.name}-{st.st_size}-{st.st_mtime_ns}"
            if (kept / "tokenizer.json").is_file():
                with contextlib.suppress(TokenizerError):
                    return cls.from_dir(kept)
        tok, config, extra = tokenizer_from_gguf(first)
        out = cls(tok, config, where=str(first), extra_eos_ids=extra)
        if kept is not None:
            _keep(kept, tok, config, out.eos_token_ids)
        return out

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """A checkpoint directory's tokenizer.json, or a ``.gguf`` file's own tokenizer (converted
        once into the model cache, see bundled.cache_dir)."""
        p = Path(path)
        if p.suffix.lower() == ".gguf" and p.is_file():
            from swarm.model.bundled import cache_dir

            return cls.from_gguf(p, cache=cache_dir() / "tokenizers")
        return cls.from_dir(p)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def vocab(self) -> dict[str, int]:
        """Every token (added tokens included) and its id (a draft's tokenizer is compared with it)."""
        return dict(self._tok.get_vocab(with_added_tokens=True))

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
