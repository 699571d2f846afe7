"""Sans-I/O codec for OpenAI's Completions API: a ``POST /v1/completions`` body in, text
completions and their chunks out.

:func:`read_body` validates a body into a :class:`CompletionBody` or raises
:class:`~sessions.errors.ProtocolError` naming the param. Every field of openai-python's
``CompletionCreateParams`` has its answer here (docs/protocol.md, "Completions"): served,
accepted and ignored (:data:`IGNORED`), or refused with ``unsupported_value``
(:data:`REFUSED`); a field no SDK knows gets ``unknown_parameter``. The prompt is the
client's, sent to the engine as it is: a string, a list of strings, a list of token ids or a
list of those (one answer, or ``n``, per prompt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.engines.base import MAX_TOP_LOGPROBS, Prompt, PromptLogprobs, TokenLogprob
from sessions.codec import (
    JSON,
    MAX_CHOICES,
    UNSET,
    Reader,
    Unset,
    json_body,
    read_completion_fields,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) when a request sets none
MAX_LOGPROBS = MAX_TOP_LOGPROBS  # alternatives per token (OpenAI's legacy limit: 5)
MAX_PROMPTS = MAX_CHOICES  # prompts in one request (each at least one choice: --max-choices)

SERVED = frozenset(
    {
        "model",
        "prompt",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "n",
        "best_of",
        "echo",
        "logprobs",
        "suffix",
    }
)
# Accepted and ignored, each for a reason a client can rely on.
IGNORED: dict[str, str] = {
    "user": "an end-user id for abuse monitoring; this gateway keys nothing on it",
}
# Refused with unsupported_value unless they ask for nothing (null, empty).
REFUSED: dict[str, str] = {
    "logit_bias": "The engines here take no logit bias.",
}
_FIELDS = SERVED | frozenset(IGNORED) | frozenset(REFUSED)


@dataclass(frozen=True, slots=True)
class CompletionBody:
    prompts: tuple[Prompt, ...]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float | Unset | None = UNSET
    top_p: float | Unset | None = UNSET
    seed: int | None = None
    stop: tuple[str, ...] | Unset = UNSET
    frequency_penalty: float | Unset | None = UNSET
    presence_penalty: float | Unset | None = UNSET
    n: int = 1  # choices returned per prompt
    best_of: int | None = None  # choices generated per prompt, the best n returned
    echo: bool = False
    logprobs: int | None = None  # the top tokens at each position (the legacy shape)
    suffix: str | None = None

    @property
    def generated(self) -> int:
        """Choices generated per prompt."""
        return self.best_of or self.n


@dataclass(frozen=True, slots=True)
class CompletionCreate:
    """The one command of a Completions session: answer this body."""

    body: CompletionBody


def decode(frame: str | bytes) -> CompletionCreate:
    """A request body (JSON) as the session's command. Raises :class:`ProtocolError`."""
    return CompletionCreate(read_body(json_body(frame)))


def read_body(obj: Mapping[str, Any]) -> CompletionBody:
    r = Reader(obj, "", None)
    r.only(_FIELDS)
    for key, message in REFUSED.items():
        if obj.get(key) not in (None, {}):
            raise r.fail(key, message, "unsupported_value")
    fields: dict[str, Any] = {"prompts": _prompts(r), **read_completion_fields(r)}
    if obj.get("echo") is not None:
        fields["echo"] = r.boolean("echo")
    if obj.get("max_tokens") is not None:
        # 0 asks for the prompt alone, which only an echo returns.
        low = 0 if fields.get("echo") else 1
        fields["max_tokens"] = r.integer("max_tokens", low, 1_000_000)
    if obj.get("best_of") is not None:
        fields["best_of"] = r.integer("best_of", 1, MAX_CHOICES)
        if fields["best_of"] < fields.get("n", 1):
            raise r.fail("best_of", "'best_of' must be at least 'n'.")
    if obj.get("logprobs") is not None:
        fields["logprobs"] = r.integer("logprobs", 0, MAX_LOGPROBS)
    if obj.get("suffix") is not None:
        fields["suffix"] = r.string("suffix")
    if obj.get("user") is not None:
        r.string("user", max_chars=256)
    return CompletionBody(**fields)


def _prompts(r: Reader) -> tuple[Prompt, ...]:
    """The prompt as the list of prompts it stands for: a string or a list of token ids is
    one; a list of strings, or of lists of token ids, is several."""
    raw = r.required("prompt")
    if isinstance(raw, str):
        return (_text(r, raw),)
    if not isinstance(raw, list) or not raw:
        raise r.fail(
            "prompt",
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, and not empty.",
            "invalid_type" if not isinstance(raw, list) else "invalid_value",
        )
    if all(_is_id(t) for t in raw):
        return (tuple(raw),)
    if len(raw) > MAX_PROMPTS:
        raise r.fail("prompt", f"'prompt' holds at most {MAX_PROMPTS} prompts.")
    prompts: list[Prompt] = []
    for index, item in enumerate(raw):
        if isinstance(item, str):
            prompts.append(_text(r, item, index))
        elif isinstance(item, list) and item and all(_is_id(t) for t in item):
            prompts.append(tuple(item))
        else:
            raise r.fail(
                f"prompt[{index}]",
                f"'prompt[{index}]' must be a string or a non-empty list of token ids "
                "(integers from 0), as every other prompt of the list.",
                "invalid_type",
            )
    return tuple(prompts)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text(r: Reader, text: str, index: int | None = None) -> str:
    if not text:
        key = "prompt" if index is None else f"prompt[{index}]"
        raise r.fail(key, f"'{key}' is empty: send the text the answer continues.")
    return text


# -- what the gateway sends -------------------------------------------------------------


def logprobs_json(logprobs: Sequence[TokenLogprob], offset: int = 0) -> JSON:
    """Tokens' log probabilities in the legacy shape; ``offset``: where the first token's
    text starts in its choice's text (``text_offset`` counts from the text's start)."""
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{top.token: top.logprob for top in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def prompt_logprobs_json(prompt: PromptLogprobs) -> JSON:
    """An echoed prompt's tokens in the legacy shape: its first token has no log
    probability (nothing before it predicts it), so its entries are null."""
    rest = logprobs_json(prompt.tokens, len(prompt.first))
    return {
        "tokens": [prompt.first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def joined_logprobs(parts: Sequence[JSON]) -> JSON:
    """Legacy log probabilities of consecutive pieces of one text, as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [value for part in parts for value in part[key]] for key in keys}


def mean_logprob(logprobs: Sequence[TokenLogprob] | None) -> float:
    """What ``best_of`` ranks an answer by: its tokens' mean log probability."""
    if not logprobs:
        return float("-inf")
    return sum(lp.logprob for lp in logprobs) / len(logprobs)


def choice_json(index: int, text: str, finish_reason: str | None, logprobs: JSON | None) -> JSON:
    """One choice of a ``text_completion`` (a chunk's has ``finish_reason`` null until its
    last)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
