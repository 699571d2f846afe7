"""A simulated continuous-batching engine, for tests and benchmarks.

It behaves like the real thing where the gateway can tell: one step loop, one
token per running stream per step, at most ``max_batch`` streams a step, the
prompt counted from the whole rendered conversation, steps on a fixed clock
whatever the event loop is doing (as a GPU's are), a deterministic answer
derived from the prompt (with Korean and emoji, so UTF-8 handling is
exercised), ``max_output_tokens`` and ``stop`` honoured (the other sampling settings,
``temperature``, ``top_p``, ``seed`` and the penalties, are accepted and change nothing:
the answer is a function of the prompt alone), and an aborted stream
dropped at the next step boundary. Each step is reported to the scheduler as one
batch, as a real engine's iteration is. Fault knobs make it fail or stall on demand.

It calls tools by a fixed rule, so that every client can be tested without a
model (:func:`tool_call_plan`, :func:`tool_output_answer`): a request with tools
whose last user message names one gets one call of the first tool named, streamed a
few characters a step; ``tool_choice`` ``required`` calls the first tool whatever the
message says, a named function is always called, ``none`` never calls. The arguments
are a valid instance of the tool's parameters whose strings are that message (so a
tool of one ``text`` parameter gets ``{"text": <that message>}``); a custom tool's input
is the message, or, under a grammar, a text the grammar accepts. After a tool's output
the answer quotes that output verbatim. An answer under a response format is a valid
instance of its schema (gateway/engines/instances.py), its strings the answer's words;
like every engine's, it is not continued after a takeover (``Engine.continues``), though
the sim could: tests see what a real engine does.

It reports log probabilities when asked, deterministic ones so that tests can check
them (:func:`token_logprob`, :func:`prompt_logprobs`): a token's depends on its
text and its place in the answer alone, so a continued answer's are those the
first gateway would have sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import random
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias

from gateway.engines import instances
from gateway.engines.base import (
    Constraint,
    ContextOverflowError,
    Engine,
    EngineError,
    Finished,
    FinishReason,
    GenerationRequest,
    Message,
    PromptLogprobs,
    PromptTokens,
    StepOutput,
    TextDelta,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    Usage,
    check_token_ids,
    fit_to_context,
)

_WORDS = (
    "the",
    "gateway",
    "streams",
    "tokens",
    "to",
    "every",
    "browser",
    "and",
    "engine",
    "batch",
    "queue",
    "fair",
    "fast",
    "cancel",
    "stop",
    "answer",
    "model",
    "step",
    "socket",
    "session",
    "안녕하세요",
    "스트리밍",
    "토큰",
    "비동기",
    "추론",
    "대화",
    "모델",
    "🚀",
    "✨",
    "🙂",
    "—",
    "déjà",
    "naïve",
)
_WORD_BITS = len(_WORDS).bit_length()
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_MESSAGE_OVERHEAD = 4  # like a chat template's role markers
_MAX_CATCH_UP = 50  # missed steps run back to back after the event loop was away
VOCAB_SIZE = 50_000  # a raw prompt's token ids: each stands for one of the words above
FILL_MARK = "<|fill|>"  # between a prompt and its suffix: the answer fills the middle
ARGUMENT_PIECE_CHARS = 8  # a call's arguments stream this many characters a step
TOOL_ANSWER_PREFIX = "The tool returned: "


def count_tokens(messages: Sequence[Message]) -> int:
    """Tokens of the rendered conversation: words and symbols plus per-message markers."""
    return sum(_MESSAGE_OVERHEAD + _text_tokens(_content(m)) for m in messages) + 2


@functools.lru_cache(maxsize=1 << 16)
def _text_tokens(text: str) -> int:
    # Every turn resends the whole conversation: a real engine's prefix cache makes that
    # cheap, and this cache does the same for the simulation's own counting.
    return len(_TOKEN_RE.findall(text))


def _content(message: Message) -> str:
    """What a message puts in the prompt: its text, and the calls it made."""
    if not message.tool_calls:
        return message.text
    return message.text + "".join(f"{c.name}({c.arguments})" for c in message.tool_calls)


def render(messages: Sequence[Message]) -> str:
    return "".join(f"<|{m.role}|>{_content(m)}<|end|>" for m in messages) + "<|assistant|>"


def decode_ids(ids: Sequence[int]) -> str:
    """The text of a raw prompt's token ids: the sim's vocabulary is its words, in turn."""
    return " ".join(_WORDS[i % len(_WORDS)] for i in ids)


def raw_prompt(request: GenerationRequest) -> tuple[str, int]:
    """A raw prompt's text as the sim answers it (the suffix after a fill mark) and its
    tokens (words and symbols of text, or the ids themselves)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        text, tokens = prompt, _text_tokens(prompt)
    else:
        assert prompt is not None
        text, tokens = decode_ids(prompt), len(prompt)
    if request.suffix is not None:
        text += FILL_MARK + request.suffix
    return text, tokens


def answer_tokens(prompt: str, length: int) -> list[str]:
    """The deterministic answer to ``prompt``: ``length`` tokens, a word and its space each."""
    rng = random.Random(hashlib.sha256(prompt.encode()).digest())
    # rng.choice(_WORDS) for each word, inline (the same draws, two calls less a word).
    bits, count, size = rng.getrandbits, len(_WORDS), _WORD_BITS
    words = []
    for _ in range(length):
        r = bits(size)
        while r >= count:
            r = bits(size)
        words.append(_WORDS[r])
    tokens = [(" " if i else "") + w for i, w in enumerate(words)]
    if tokens:
        tokens[0] = tokens[0].capitalize()
        tokens[-1] += "."
    return tokens


_PROMPT_TOKEN_RE = re.compile(r"<\|\w+\|>|\s*\w+|\s*[^\w\s]|\s+")


_LEADING = {lead: tuple(lead + word for word in _WORDS) for lead in ("", " ")}


def token_logprob(token: str, position: int, top: int) -> TokenLogprob:
    """The sim's log probability of ``token`` at ``position`` (from 0) of an answer, with
    ``top`` alternatives: the token itself first, then other words (from the word list,
    at a place that moves with ``position``), each less likely than the one before."""
    logprob = -0.05 - 0.125 * (position % 8)
    raw = token.encode()
    if not top:
        return TokenLogprob(token, logprob, raw)
    words = _LEADING[" " if token.startswith(" ") else ""]
    alternatives = [TokenLogprob(token, logprob, raw)]
    at = position
    while len(alternatives) < top:
        text = words[at % len(words)]
        at += 1
        if text != token:
            value = logprob - 0.75 * len(alternatives)
            alternatives.append(TokenLogprob(text, value, text.encode()))
    return TokenLogprob(token, logprob, raw, tuple(alternatives))


def prompt_logprobs(prompt: str, top: int) -> PromptLogprobs:
    """The rendered ``prompt``'s tokens (the pieces it splits into, joined: the prompt)
    with the sim's log probabilities: its first token has none, the others
    :func:`token_logprob`'s, by their place in the prompt."""
    pieces = _PROMPT_TOKEN_RE.findall(prompt)
    return PromptLogprobs(
        pieces[0] if pieces else "",
        tuple(token_logprob(p, i, top) for i, p in enumerate(pieces[1:], 1)),
    )


def tool_call_plan(request: GenerationRequest) -> tuple[ToolCallDelta, ...]:
    """The call the sim makes for ``request``, as the deltas it streams; () for a text answer.

    ``auto``: the first tool (in the request's order) whose name the last user message
    contains, unless the last message is a tool's output (then the model answers it).
    ``required``: the first tool. A named function: that one. ``none``: no call.
    """
    if not request.tools or request.tool_choice == "none":
        return ()
    messages = request.messages
    user_text = next((m.text for m in reversed(messages) if m.role == "user"), "")
    tool: Tool | None
    if request.tool_choice == "required":
        tool = request.tools[0]
    elif request.tool_choice != "auto":
        tool = next((t for t in request.tools if t.name == request.tool_choice), None)
    elif messages and messages[-1].role == "tool":
        tool = None
    else:
        tool = next((t for t in request.tools if t.name in user_text), None)
    if tool is None:
        return ()
    arguments = tool_arguments(tool, user_text)
    digest = hashlib.sha256(f"{request.request_id}/{tool.name}".encode()).hexdigest()
    pieces = [
        arguments[i : i + ARGUMENT_PIECE_CHARS]
        for i in range(0, len(arguments), ARGUMENT_PIECE_CHARS)
    ]
    first = ToolCallDelta(0, pieces[0], call_id=f"call_{digest[:16]}", name=tool.name)
    return (first, *(ToolCallDelta(0, piece) for piece in pieces[1:]))


def tool_arguments(tool: Tool, user_text: str) -> str:
    """The arguments the sim gives ``tool``: see the module docstring."""
    if tool.freeform:
        text = user_text
        if tool.grammar is not None:
            text = instances.text_instance(tool.grammar, seed=user_text)
        return json.dumps({"input": text}, ensure_ascii=False)
    schema = json.dumps(dict(tool.parameters), sort_keys=True)
    return instances.json_text(schema, (user_text,))


def formatted_answer(constraint: Constraint, prompt: str) -> list[str]:
    """An answer under a response format, in pieces of a few characters (its tokens)."""
    words = "".join(answer_tokens(prompt, 12)).rstrip(".").split()
    phrases = tuple(" ".join(words[i : i + 3]) for i in range(0, len(words), 3))
    definition = constraint.definition if constraint.kind == "json_schema" else _ANY_OBJECT
    text = instances.json_text(definition, phrases)
    return [text[i : i + ARGUMENT_PIECE_CHARS] for i in range(0, len(text), ARGUMENT_PIECE_CHARS)]


_ANY_OBJECT = '{"type": "object", "properties": {"answer": {"type": "string"}}}'


def tool_output_answer(messages: Sequence[Message]) -> list[str] | None:
    """After a tool's output, the answer quotes it verbatim: its tokens, or None."""
    if not messages or messages[-1].role != "tool":
        return None
    output = messages[-1].text
    return [TOOL_ANSWER_PREFIX, *re.findall(r"\s*\S+|\s+", output)]


def _cut_at_stop(tokens: list[str], stop: Sequence[str]) -> list[str]:
    """Tokens up to (not including) the first stop sequence."""
    text = "".join(tokens)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    if not cuts:
        return tokens
    keep, out = min(cuts), []
    for token in tokens:
        if keep <= 0:
            break
        out.append(token[:keep])
        keep -= len(token)
    return out


_Plan: TypeAlias = tuple[list[str | ToolCallDelta], FinishReason, int, str]
"""An answer's tokens, how it ends, and its prompt's tokens and text."""


@dataclass(eq=False, slots=True)
class _Stream:
    request_id: str
    tokens: deque[str | TextDelta | ToolCallDelta]  # TextDelta: a token with its logprob
    finish: FinishReason
    usage_in: int
    generated: int = 0  # the whole answer's: a continuation starts at what was sent
    aborted: bool = False  # abort() asked: confirmed and dropped at the next step
    prompt_logprobs: PromptLogprobs | None = None  # reported with the prompt's tokens


def _after(tokens: list[str | ToolCallDelta], sent: str) -> list[str | ToolCallDelta]:
    """The tokens of a deterministic answer that follow the text already ``sent``: the
    answer continued elsewhere is the answer the first gateway would have given."""
    told = ""
    for index, token in enumerate(tokens):
        if len(told) >= len(sent):
            return tokens[index:]
        told += token if isinstance(token, str) else ""
    return []


class SimEngine(Engine):
    name = "sim"
    can_continue = True
    can_fill_in_middle = True
    reports_logprobs = True
    reports_prompt_logprobs = True

    def __init__(
        self,
        *,
        step_ms: float = 20.0,
        max_batch: int = 64,
        response_tokens: int = 64,
        context_tokens: int | None = None,
        fail_after: int | None = None,
        stall_after: int | None = None,
    ) -> None:
        super().__init__()
        self.step_s = step_ms / 1000
        self.max_batch = max_batch
        self.response_tokens = response_tokens
        self.context_tokens = context_tokens
        self.fail_after = fail_after
        self.stall_after = stall_after
        self._streams: dict[str, _Stream] = {}  # in arrival order: the first max_batch run
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.steps = 0
        self.tokens_generated = 0

    @property
    def capacity(self) -> int:
        return self.max_batch

    @property
    def active(self) -> int:
        """Streams the step loop still holds (aborted ones leave at the next step)."""
        return len(self._streams)

    async def start(self) -> None:
        await super().start()
        self._loop_task = asyncio.get_running_loop().create_task(
            self._step_loop(), name="sim-steps"
        )

    async def close(self) -> None:
        await super().close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._streams.clear()

    def describe(self) -> dict[str, object]:
        return {"model": "sim", "step_ms": self.step_s * 1000, "max_batch": self.max_batch}

    @property
    def context_window(self) -> int | None:
        return self.context_tokens

    def check_structure(self, request: GenerationRequest) -> None:
        """The sim constrains anything it can make an instance of (its answers are built
        valid): a schema or grammar it cannot satisfy is refused here."""
        if request.constraint is not None:
            formatted_answer(request.constraint, "")
        if request.enforces_tools:
            for tool in request.tools:
                tool_arguments(tool, "")

    def submit(self, request: GenerationRequest) -> None:
        try:
            stream = self._open(request)
        except EngineError as exc:
            self.outputs.put(request.request_id, exc)
            return
        self._streams[request.request_id] = stream
        self._wake.set()

    def check(self, request: GenerationRequest) -> None:
        if request.prompt is not None and not isinstance(request.prompt, str):
            check_token_ids(request.prompt, VOCAB_SIZE)
        super().check(request)

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.aborted = True

    def _open(self, request: GenerationRequest) -> _Stream:
        budget = request.sampling.max_output_tokens
        plan = self._plan_raw if request.prompt is not None else self._plan_chat
        tokens, finish, prompt_tokens, prompt = plan(request)
        sent = 0  # tokens of the answer a stopped gateway already sent (a continuation)
        if request.continuation and finish != "tool_calls":
            rest = _after(tokens, request.continuation)
            sent = len(tokens) - len(rest)
            tokens = rest
        # The budget and the usage are the whole answer's, what was sent before included.
        if budget is not None and sent + len(tokens) > budget:
            tokens, finish = tokens[: max(0, budget - sent)], "length"
        top = request.sampling.logprobs
        outputs: Sequence[str | TextDelta | ToolCallDelta] = tokens
        if top is not None:  # made now, so that a step costs what it did without them
            outputs = [
                TextDelta(t, logprobs=(token_logprob(t, sent + i, top),))
                if isinstance(t, str)
                else t
                for i, t in enumerate(tokens)
            ]
        stream = _Stream(request.request_id, deque(outputs), finish, prompt_tokens, sent)
        if request.sampling.prompt_logprobs is not None:
            stream.prompt_logprobs = prompt_logprobs(prompt, request.sampling.prompt_logprobs)
        return stream

    def _plan_chat(self, request: GenerationRequest) -> _Plan:
        """A conversation's answer: its tokens, how it ends, the prompt's tokens and text."""
        messages: Sequence[Message] = request.messages
        budget = request.sampling.max_output_tokens
        if self.context_tokens is not None:
            answer_room = min(budget or self.response_tokens, self.context_tokens // 2)
            messages, _ = fit_to_context(messages, count_tokens, self.context_tokens - answer_room)
        prompt, prompt_tokens = render(messages), count_tokens(messages)
        fitted = (
            request if messages is request.messages else replace(request, messages=tuple(messages))
        )
        if calls := tool_call_plan(fitted):
            return list(calls), "tool_calls", prompt_tokens, prompt
        if request.constraint is not None:
            answer = formatted_answer(request.constraint, prompt)
            return list(answer), "stop", prompt_tokens, prompt
        text = tool_output_answer(messages) or answer_tokens(prompt, self.response_tokens)
        return list(_cut_at_stop(text, request.sampling.stop)), "stop", prompt_tokens, prompt

    def _plan_raw(self, request: GenerationRequest) -> _Plan:
        """A raw prompt's answer, as a language model continues text: nothing is dropped
        to fit, and what cannot fit is refused."""
        text, prompt_tokens = raw_prompt(request)
        # The text goes on after the prompt: its first word too is spaced from it.
        answer = [
            " " + token if i == 0 else token
            for i, token in enumerate(answer_tokens(text, self.response_tokens))
        ]
        words: list[str | ToolCallDelta] = list(_cut_at_stop(answer, request.sampling.stop))
        finish: FinishReason = "stop"
        if self.context_tokens is not None:
            room = self.context_tokens - prompt_tokens
            if room < 1:
                raise ContextOverflowError(
                    f"the prompt has {prompt_tokens} tokens; the context window holds "
                    f"{self.context_tokens}, the answer included"
                )
            if len(words) > room:
                words, finish = words[:room], "length"
        prompt = text if request.suffix is None else text.split(FILL_MARK)[0]
        return words, finish, prompt_tokens, prompt

    async def _step_loop(self) -> None:
        # Steps fall due on a fixed clock, as on a GPU that computes whatever the
        # event loop is doing: when the loop comes back late, the missed steps run
        # at once (up to a cap), so several tokens per stream wait for the gateway,
        # as they would with a real engine.
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            if not self._streams:
                self._wake.clear()
                await self._wake.wait()
                due = loop.time()
            late = loop.time() - due
            steps = 1 + min(_MAX_CATCH_UP, int(late / self.step_s)) if self.step_s > 0 else 1
            for _ in range(steps):
                self._step()
            due += steps * self.step_s
            await asyncio.sleep(max(0.0, due - loop.time()))

    def _step(self) -> None:
        """One engine iteration: confirm aborts, one token for each of the batch, and
        report the whole step to the scheduler at once."""
        self.steps += 1
        out: list[StepOutput] = []
        ended: list[str] = []
        running = 0
        faults = self.fail_after is not None or self.stall_after is not None
        generated = 0
        for stream in self._streams.values():
            if stream.aborted:
                usage = Usage(stream.usage_in, stream.generated)
                out.append((stream.request_id, Finished("cancelled", usage)))
                ended.append(stream.request_id)
            elif running < self.max_batch:
                running += 1
                tokens = stream.tokens
                if (
                    stream.generated
                    and len(tokens) > 1
                    and not faults
                    and stream.prompt_logprobs is None
                ):
                    # _advance's common case, inline: a token, and more to come.
                    stream.generated += 1
                    generated += 1
                    out.append((stream.request_id, tokens.popleft()))
                elif self._advance(stream, out):
                    ended.append(stream.request_id)
        self.tokens_generated += generated
        for request_id in ended:
            del self._streams[request_id]
        if out:
            self.outputs.put_step(out)

    def _advance(self, stream: _Stream, out: list[StepOutput]) -> bool:
        """Append this step's output for ``stream``; True when it ended."""
        rid = stream.request_id
        if self.fail_after is not None and stream.generated >= self.fail_after:
            out.append((rid, EngineError("engine_error", "simulated engine failure")))
            return True
        if self.stall_after is not None and stream.generated >= self.stall_after:
            return False
        if stream.prompt_logprobs is not None:  # once, before the first token (if any)
            out.append((rid, stream.prompt_logprobs))
            stream.prompt_logprobs = None
        if stream.tokens:
            if not stream.generated:
                out.append((rid, PromptTokens(stream.usage_in)))
            stream.generated += 1
            self.tokens_generated += 1
            out.append((rid, stream.tokens.popleft()))
        if stream.tokens:
            return False
        out.append((rid, Finished(stream.finish, Usage(stream.usage_in, stream.generated))))
        return True


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--sim-step-ms", type=float, default=20.0, help="engine step time (0: flat out)"
    )
    group.add_argument("--sim-max-batch", type=int, default=64, help="streams per engine step")
    group.add_argument(
        "--sim-response-tokens", type=int, default=64, help="natural length of a simulated answer"
    )
    group.add_argument("--sim-context-tokens", type=int, default=None, help="context window")
    group.add_argument(
        "--sim-fail-after", type=int, default=None, help="fail every stream after N tokens"
    )
    group.add_argument(
        "--sim-stall-after", type=int, default=None, help="stall every stream after N tokens"
    )


def from_args(args: argparse.Namespace) -> SimEngine:
    return SimEngine(
        step_ms=args.sim_step_ms,
        max_batch=args.sim_max_batch,
        response_tokens=args.sim_response_tokens,
        context_tokens=args.sim_context_tokens,
        fail_after=args.sim_fail_after,
        stall_after=args.sim_stall_after,
    )
