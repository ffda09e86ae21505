"""Request parsing: what each OpenAI field becomes, and which values are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from swarm.api.requests import MAX_SEED, ApiError, parse_chat, parse_completion
from swarm.model.tokenizer import Tokenizer

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def tok(tiny_chat_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_chat_dir)


def chat(tok: Tokenizer, context: int = 512, **body: Any) -> Any:
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}, tok, MODEL, context)


def test_openai_defaults(tok: Tokenizer) -> None:
    spec = chat(tok)
    assert spec.temperature == 1.0 and spec.top_p == 1.0 and spec.top_k == 0
    assert spec.seed is not None and 0 <= spec.seed <= MAX_SEED  # sampled: a fresh seed
    assert chat(tok).seed != spec.seed
    assert spec.max_new_tokens == 512 - len(spec.prompt_ids) and not spec.stream and spec.stops == ()
    assert chat(tok, temperature=0).seed is None


def test_fields_map_to_the_spec(tok: Tokenizer) -> None:
    spec = chat(tok, temperature=0.5, top_p=0.9, top_k=40, seed=-1, stop="##", max_completion_tokens=7, stream=True,
                stream_options={"include_usage": True}, user="u1", n=1, logprobs=False, presence_penalty=0)  # fmt: skip
    assert (spec.temperature, spec.top_p, spec.top_k, spec.max_new_tokens) == (0.5, 0.9, 40, 7)
    assert spec.seed == MAX_SEED and spec.stops == ("##",) and spec.stream and spec.include_usage


def test_chat_template_gets_every_turn(tok: Tokenizer) -> None:
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
            {"type": "text", "text": "b"}]}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "c"}]  # fmt: skip
    spec = parse_chat({"model": MODEL, "messages": msgs}, tok, MODEL, 512)
    text = tok.decode(spec.prompt_ids, skip_special_tokens=False)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
                    "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip


def test_completion_prompts(tok: Tokenizer) -> None:
    assert parse_completion({"model": MODEL, "prompt": "ab"}, tok, MODEL, 64, 100).prompt_ids == tok.encode("ab")
    assert parse_completion({"model": MODEL, "prompt": ["ab"]}, tok, MODEL, 64, 100).prompt_ids == tok.encode("ab")
    assert parse_completion({"model": MODEL, "prompt": [[5, 6]]}, tok, MODEL, 64, 100).prompt_ids == [5, 6]
    with pytest.raises(ApiError, match="empty"):
        parse_completion({"model": MODEL, "prompt": ""}, tok, MODEL, 64, 100)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"stop": [""]}, "stop", "invalid_value"),
        ({"seed": 1.5}, "seed", "invalid_value"),
        ({"top_p": 1.5}, "top_p", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": True}, "max_tokens", "invalid_value"),
        ({"stream": "yes"}, "stream", "invalid_value"),
        ({"logit_bias": {"5": 10}}, "logit_bias", "unsupported_parameter"),
        ({"frequency_penalty": 0.1}, "frequency_penalty", "unsupported_parameter"),
        ({"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
        ({"best": 1}, "best", "unrecognized_argument"),
    ],
)
def test_refused(tok: Tokenizer, body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ApiError) as info:
        chat(tok, **body)
    assert (info.value.param, info.value.code, info.value.status) == (param, code, 400)
    assert info.value.body()["error"]["message"] == info.value.message


def test_context_limit(tok: Tokenizer) -> None:
    n = len(chat(tok).prompt_ids)
    assert chat(tok, context=n + 1).max_new_tokens == 1
    with pytest.raises(ApiError) as info:
        chat(tok, context=n)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(ApiError, match="exceed the context"):
        chat(tok, context=n + 5, max_tokens=6)


def test_a_prompt_that_cannot_fit_is_refused_unread(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes / (2 x the longest token) is a lower bound on the token count: past the context, the
    prompt is refused without tokenizing it; just under the bound, it is tokenized as before."""
    assert tok.max_token_bytes == len("<|endoftext|>")  # the tiny vocabulary's longest entry
    calls: list[int] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: calls.append(len(text)) or real(text, **kw))
    huge = "a" * (2 * tok.max_token_bytes * 513)
    with pytest.raises(ApiError, match="at least 513 tokens") as info:
        parse_completion({"model": MODEL, "prompt": huge}, tok, MODEL, 512, 200)
    assert info.value.code == "context_length_exceeded" and calls == []
    with pytest.raises(ApiError, match="the prompt is 100 tokens"):
        parse_completion({"model": MODEL, "prompt": "a" * 100}, tok, MODEL, 99, 200)
    assert calls == [100]


def test_missing_or_wrong_model(tok: Tokenizer) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": [{"role": "user", "content": "x"}]}, tok, MODEL, 64)
    assert info.value.param == "model"
    with pytest.raises(ApiError) as info:
        parse_chat({"model": "other", "messages": [{"role": "user", "content": "x"}]}, tok, MODEL, 64)
    assert info.value.status == 404 and info.value.code == "model_not_found"
