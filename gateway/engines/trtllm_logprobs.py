"""TensorRT-LLM's log probabilities in the engine interface's terms.

TensorRT-LLM (1.x, ``executor/result.py``) reports them per position, in
``CompletionOutput.logprobs`` (generated tokens, cumulative; ``logprobs_diff`` the new
ones) and ``CompletionOutput.prompt_logprobs`` (position ``t`` predicts prompt token
``t + 1``): a dict, token id -> ``Logprob(logprob, rank)``, of the top
``SamplingParams.logprobs`` tokens there; the PyTorch sampler keeps the top-k alone, so the
token it sampled is in the dict only if it ranks that high (``_torch/pyexecutor/
sampler.py``, ``handle_logprobs``). Some paths give a plain float per token instead (the
sampled token's alone).

So the adapter asks TensorRT-LLM for the top :data:`~gateway.engines.base.MAX_TOP_LOGPROBS`
whatever the client wants: a token's own log probability is then known whenever it ranks
among the 20 likeliest, which is OpenAI's rule (else ``-9999.0``); the client's ``N``
alternatives are the first ``N``. A token's text is decoded in its context (the tokens
before it), so that it keeps its leading space; its bytes are that text's UTF-8, as
trtllm-serve reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gateway.engines.base import (
    MIN_LOGPROB,
    LogprobsUnsupportedError,
    PromptLogprobs,
    StreamEvent,
    TextDelta,
    TokenLogprob,
    clamp_logprob,
)

CONTEXT = 4  # tokens decoded before a token, to tell its text with its leading space


class TokenText:
    """A token's text as it reads after the tokens before it (a tokenizer's ``decode`` of
    one id drops a SentencePiece token's leading space)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens

    def after(self, before: Sequence[int], token_ids: Sequence[int]) -> list[str]:
        """The text of each of ``token_ids`` in turn, each following ``before``."""
        context = list(before[-CONTEXT:])
        head = self._text(context) if context else ""
        texts = []
        for token_id in token_ids:
            full = self._text([*context, token_id])
            texts.append(full[len(head) :] if full.startswith(head) else self._text([token_id]))
        return texts

    def _text(self, ids: list[int]) -> str:
        text: str = self._decode(ids, skip_special_tokens=self._skip)
        return text


def token_logprob(
    text: TokenText, before: Sequence[int], token_id: int, entry: Any, top: int
) -> TokenLogprob:
    """The token ``token_id`` (after ``before``) with what TensorRT-LLM reported at its
    position (``entry``: the top-k dict, or a float), and ``top`` alternatives."""
    token = text.after(before, [token_id])[0]
    if not isinstance(entry, dict):
        value = float(entry) if isinstance(entry, int | float) else MIN_LOGPROB
        return TokenLogprob(token, clamp_logprob(value), token.encode())
    own = entry.get(token_id)
    value = clamp_logprob(own.logprob) if own is not None else MIN_LOGPROB
    if not top:
        return TokenLogprob(token, value, token.encode())
    ranked = sorted(entry.items(), key=lambda item: _rank(item[1]))[:top]
    texts = text.after(before, [tid for tid, _ in ranked]) if ranked else []
    alternatives = tuple(
        TokenLogprob(t, clamp_logprob(lp.logprob), t.encode())
        for t, (_, lp) in zip(texts, ranked, strict=True)
    )
    return TokenLogprob(token, value, token.encode(), alternatives)


def _rank(logprob: Any) -> float:
    rank = getattr(logprob, "rank", None)
    return float(rank) if rank is not None else -float(logprob.logprob)


def prompt_logprobs(
    tokenizer: Any, prompt_ids: Sequence[int], reported: Sequence[Any], top: int
) -> PromptLogprobs:
    """The prompt's tokens (special ones too: they are in the prompt's text) with their log
    probabilities: position ``t - 1``'s entry is token ``t``'s. A report that does not
    cover every token is refused, never passed on short."""
    if len(reported) < len(prompt_ids) - 1:
        raise LogprobsUnsupportedError(
            f"TensorRT-LLM reported log probabilities for {len(reported)} of the prompt's "
            f"{len(prompt_ids) - 1} predicted tokens."
        )
    text = TokenText(tokenizer, skip_special_tokens=False)
    first = text.after((), prompt_ids[:1])[0] if prompt_ids else ""
    tokens = tuple(
        token_logprob(text, prompt_ids[:t], prompt_ids[t], reported[t - 1], top)
        for t in range(1, len(prompt_ids))
    )
    return PromptLogprobs(first, tokens)


class LogprobCursor:
    """Gives each text delta of one stream the log probabilities of the tokens generated
    since the last one (as ``_TokenIds`` gives their ids); the tokens of a tool call give
    theirs to nothing (OpenAI reports those of the content alone)."""

    def __init__(self, tokenizer: Any, top: int) -> None:
        self._text = TokenText(tokenizer, skip_special_tokens=True)
        self._top = top
        self._given = 0

    def attach(self, event: StreamEvent, completion: Any) -> StreamEvent:
        if not isinstance(event, TextDelta):
            self.skip(completion)
            return event
        return replace(event, logprobs=self._take(completion))

    def skip(self, completion: Any) -> None:
        self._given = len(completion.token_ids)

    def _take(self, completion: Any) -> tuple[TokenLogprob, ...]:
        token_ids: Sequence[int] = completion.token_ids
        reported: Sequence[Any] = completion.logprobs or ()
        if len(reported) < len(token_ids):
            raise LogprobsUnsupportedError(
                "TensorRT-LLM returned tokens without their log probabilities."
            )
        start, self._given = self._given, len(token_ids)
        return tuple(
            token_logprob(self._text, token_ids[:i], token_ids[i], reported[i], self._top)
            for i in range(start, len(token_ids))
        )
