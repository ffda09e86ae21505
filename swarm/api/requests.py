"""OpenAI request bodies -> one validated generation spec, or an OpenAI-style error.

Every field of the OpenAI chat and completions requests is in one of three sets:

* supported: it changes the output and the swarm does it (temperature, top_p, max_tokens, stop,
  seed, stream, ...);
* harmless: it does not change the output (user, metadata, store, ...), accepted and ignored;
* refused unless it has its no-op value: n > 1, logprobs, tools, response_format other than
  text, penalties, logit_bias, ... get a 400 error naming the parameter, never a silent ignore.

A field in none of them is refused as unrecognized, as OpenAI does. The request becomes one
:class:`~swarm.proto.control.Gen`, the swarm's one generation request, checked against its bounds
(temperature [0, 2], top_p (0, 1], max_tokens 1..4096, ...) where it is built, here. Defaults
follow OpenAI (temperature 1, top_p 1), where ``shard-swarm generate`` and the wire default to
greedy (temperature 0) as the CLI documents; ``max_tokens`` defaults to what is left of the
context (at most 4096). A sampled request without a seed gets a random one, so repeated calls
differ. OpenAI seeds may be negative: they are mapped into the swarm's [0, 2^63) range.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from swarm.errors import BadRequest, SwarmError, TokenizerError
from swarm.model.tokenizer import Tokenizer
from swarm.proto.control import MAX_NEW_TOKENS, Gen

MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_SEED = (1 << 63) - 1


class ApiError(SwarmError):
    """An error the endpoint answers with an OpenAI-style error object."""

    def __init__(
        self, message: str, *, status: int = 400, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.retry_after_s: int | None = None  # sent as Retry-After (a 429 when the swarm is busy)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenSpec:
    """One OpenAI request: the swarm's generation request and what only the endpoint handles."""

    kind: str  # "chat" or "completion"
    model: str
    request: Gen  # prompt ids, length and sampling, checked against the swarm's one set of bounds
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.request.ids)

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.request.temperature

    @property
    def top_p(self) -> float:
        return self.request.top_p

    @property
    def top_k(self) -> int:
        return self.request.top_k

    @property
    def seed(self) -> int | None:
        return self.request.seed


_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed", "n",
           "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user", "metadata", "store",
           "service_tier", "draft"}  # fmt: skip  (draft: the swarm's own, e.g. "none", "ngram", "auto")
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "parallel_tool_calls", "response_format", "reasoning_effort", "modalities",
                   "audio", "prediction", "web_search_options"}  # fmt: skip
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}

# parameter -> the values that leave the output unchanged (anything else is refused)
_NOOP: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "reasoning_effort": (None,), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
}  # fmt: skip
_WHY = {
    "n": "this swarm returns one choice per request",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
}


def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    for key in body:
        if key not in known:
            raise ApiError(f"Unrecognized request argument supplied: {key}", param=key, code="unrecognized_argument")
    for key, ok in _NOOP.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) for v in ok):
            why = _WHY.get(key, "the swarm cannot honour it")
            raise ApiError(f"{key}={body[key]!r} is not supported ({why})", param=key, code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError("response_format other than {'type': 'text'} is not supported", param="response_format",
                       code="unsupported_parameter")  # fmt: skip


def _integer(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(f"{key} must be an integer in [{lo}, {hi}], got {v!r}", param=key, code="invalid_value")
    return v


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError("stop must be a string or a list of strings", param="stop", code="invalid_value")
    if len(items) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in items):
        raise ApiError(f"stop takes at most {MAX_STOPS} sequences of at most {MAX_STOP_CHARS} characters", param="stop",
                       code="invalid_value")  # fmt: skip
    if any(s == "" for s in items):
        raise ApiError("stop sequences must not be empty", param="stop", code="invalid_value")
    return tuple(items)


def _common(body: dict[str, Any], kind: str, served: str, prompt_ids: list[int], context: int) -> GenSpec:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("you must give the model (see GET /v1/models)", param="model", code="missing_model")
    if model != served:
        raise ApiError(f"The model {model!r} does not exist; this swarm serves {served!r}", status=404, param="model",
                       code="model_not_found")  # fmt: skip
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError("stream must be true or false", param="stream", code="invalid_value")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise ApiError("stream_options may only hold include_usage", param="stream_options", code="invalid_value")
    if opts and not stream:
        raise ApiError("stream_options is only allowed with stream=true", param="stream_options", code="invalid_value")
    room = context - len(prompt_ids)
    if room < 1:
        raise ApiError(f"the prompt is {len(prompt_ids)} tokens; this swarm's context holds {context}",
                       param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")  # fmt: skip
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    seed = _integer(body, "seed", -MAX_SEED, MAX_SEED)
    if seed is not None and seed < 0:
        seed += MAX_SEED + 1  # keep negative seeds distinct and in the swarm's range
    temperature = body.get("temperature")
    try:  # the swarm's bounds, checked once, here (proto.control.Gen)
        req = Gen.checked(prompt_ids, max_new_tokens=body.get(key), temperature=1.0 if temperature is None else temperature,
                          top_p=body.get("top_p"), top_k=body.get("top_k"), seed=seed, draft=body.get("draft"))  # fmt: skip
    except BadRequest as exc:
        param = {"max_new_tokens": key}.get(exc.field, exc.field)
        raise ApiError(f"{param}: {str(exc).split(': ', 1)[-1]}", param=param, code="invalid_value") from None
    if body.get(key) is not None and req.max_new_tokens > room:
        raise ApiError(f"{key}={req.max_new_tokens} plus the prompt's {len(prompt_ids)} tokens exceed the context of "
                       f"{context}", param=key, code="context_length_exceeded")  # fmt: skip
    if body.get(key) is None:
        req = dataclasses.replace(req, max_new_tokens=min(room, MAX_NEW_TOKENS))
    if req.seed is None and req.temperature > 0:
        req = dataclasses.replace(req, seed=int.from_bytes(os.urandom(8), "little") & MAX_SEED)
    return GenSpec(kind=kind, model=model, request=req, stops=_stops(body), stream=stream,
                   include_usage=bool(opts.get("include_usage", False)))  # fmt: skip


def _content(msg: dict[str, Any], i: int) -> str:
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(f"messages[{i}].content: only text parts are supported, got {kind!r}",
                               param=f"messages[{i}].content", code="unsupported_content")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content",
                   code="invalid_value")  # fmt: skip


def _encode(tok: Tokenizer, text: str, context: int, param: str, special: bool = False) -> list[int]:
    """Token ids of ``text`` (``special``: with the BOS its tokenizer asks for, as for a plain
    prompt; a chat template writes its own); a text that cannot fit the context whatever its
    tokens is refused before tokenizing it (a 1 MiB prompt took 11 s to tokenize here)."""
    at_least = len(text.encode("utf-8", "surrogatepass")) // (2 * tok.max_token_bytes)  # 2x: normalizers
    if at_least > context:
        raise ApiError(f"the prompt is at least {at_least} tokens; this swarm's context holds {context}",
                       param=param, code="context_length_exceeded")  # fmt: skip
    return tok.encode(text, add_special_tokens=special)


def parse_chat(body: Any, tok: Tokenizer, served: str, context: int) -> GenSpec:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_fields(body, _CHAT)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("messages must be a non-empty list", param="messages", code="invalid_value")
    conv: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_value")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(f"messages[{i}].role {role!r} is not supported (system, user or assistant)",
                           param=f"messages[{i}].role", code="invalid_value")  # fmt: skip
        if m.get("tool_calls") or m.get("function_call"):
            raise ApiError(f"messages[{i}] carries tool calls; tool calling is not supported",
                           param=f"messages[{i}]", code="unsupported_parameter")  # fmt: skip
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
        if isinstance(m.get("name"), str):
            entry["name"] = m["name"]
        conv.append(entry)
    try:
        text = tok.apply_chat_template(conv, add_generation_prompt=True)
    except TokenizerError as exc:
        raise ApiError(f"the model's chat template refused these messages: {exc}", param="messages",
                       code="invalid_value") from None  # fmt: skip
    return _common(body, "chat", served, _encode(tok, text, context, "messages"), context)


def parse_completion(body: Any, tok: Tokenizer, served: str, context: int, vocab_size: int) -> GenSpec:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_fields(body, _COMPLETION)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = _encode(tok, p, context, "prompt", special=True)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="prompt",
                           code="invalid_value")  # fmt: skip
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1:
        raise ApiError("batched prompts are not supported: send one prompt per request", param="prompt",
                       code="unsupported_parameter")  # fmt: skip
    else:
        raise ApiError("prompt must be a string or a list of token ids", param="prompt", code="invalid_value")
    if not ids:
        raise ApiError("the prompt is empty", param="prompt", code="invalid_value")
    return _common(body, "completion", served, ids, context)
