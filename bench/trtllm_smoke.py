"""Smoke test for the TensorRT-LLM engine on a GPU machine (not part of CI).

Needs an NVIDIA GPU and TensorRT-LLM (see docs/trtllm.md for the install routes). It loads
one small model once and:

1. shows TensorRT-LLM's three generation modes side by side: synchronous ``llm.generate``,
   ``generate_async`` awaited for several prompts with ``asyncio.gather``, and
   ``generate_async(..., streaming=True)`` printing only the new text (``text_diff``);
2. serves that same LLM through the gateway in-process (``--engine trtllm``'s adapter) and
   drives it with a raw ``websockets`` client: one full answer (time to first token,
   tokens/s), then one answer cancelled mid-stream (cancel-to-``response.done`` latency);
3. checks the points of issue 14 that only a GPU can settle, each ending in a line
   ``[item N] PASS|FAIL|SKIP: ...``:

   - item 10: the LLM was built on a worker thread (or, with ``--load-on-main-thread``, on
     the main thread before anything else) and served answers;
   - item 1: the context limit the adapter derived, against the limit TensorRT-LLM's worker
     really enforces (a prompt far over it must be refused with a message naming it); a long
     conversation is trimmed and still answered, and one oversized message is answered
     with ``context_length_exceeded``, not ``engine_error``;
   - issue 31: a greedy answer continued from its first half's token ids (a takeover's
     continuation) equals the uninterrupted answer, its usage the whole answer's;
   - issue 38 (log probabilities): what ``SamplingParams(logprobs=20, prompt_logprobs=20)``
     really returns (printed), then a greedy answer through the adapter: every text delta
     carries its tokens' log probabilities, one per generated token, their texts joined the
     answer's, the sampled token the likeliest; the prompt's come first, one per prompt
     token after the first; and a Chat Completions request with ``logprobs`` answers them;
   - issue 38 structured: guided decoding (``--guided-decoding-backend``, llguidance by
     default): an answer under a JSON Schema parses and holds to it, ``tool_choice``
     ``required`` gives a call of the tool with arguments that hold to its parameters, and a
     custom tool's Lark grammar is kept; each request goes as ``GuidedDecodingParams``;
   - issue 39 (completions): ``POST /v1/completions`` on a raw prompt gives what
     ``generate_async`` gives on that prompt string (greedy), and the same from its token
     ids; an echo with ``logprobs`` and ``max_tokens: 0`` scores the prompt's tokens;
   - item 3 (last, it destroys the engine; ``--skip-crash`` to leave it out): every worker
     process is killed mid-answer; the live answer must end ``failed`` with
     ``engine_unavailable``, ``/readyz`` must turn 503, and the event loop must never stall.

The exit status is 1 if any check failed.

Run: ``python bench/trtllm_smoke.py --model TinyLlama/TinyLlama-1.1B-Chat-v1.0``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from gateway.config import GatewayConfig
from gateway.engines.trtllm import TrtllmEngine, TrtllmSettings, build_llm
from gateway.server import Gateway

QUESTIONS = [
    "Name three uses of a hash map.",
    "What does a WebSocket add over plain HTTP?",
    "Explain KV caching in one paragraph.",
    "Why does batching raise GPU throughput?",
]
LONG_ASK = "Write a long, detailed story about a lighthouse keeper. Take your time."
CRASH_DEADLINE_S = 30.0
MAX_LOOP_STALL_S = 0.5
RESULTS: list[tuple[str, str, str]] = []  # (item, PASS|FAIL|SKIP, why)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    parser.add_argument("--max-tokens", type=int, default=96, help="answer budget per prompt")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--kv-cache-fraction", type=float, default=0.5)
    parser.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="KV cache size (caps the context)"
    )
    parser.add_argument("--cancel-after", type=int, default=10, help="deltas before the cancel")
    parser.add_argument(
        "--load-on-main-thread",
        action="store_true",
        help="build the LLM on the main thread (the documented fallback of item 10)",
    )
    parser.add_argument(
        "--skip-crash", action="store_true", help="leave out item 3 (it kills the worker)"
    )
    parser.add_argument(
        "--guided-decoding-backend",
        choices=("llguidance", "xgrammar", "none"),
        default="llguidance",
        help="TensorRT-LLM's constrained decoder (issue 38's check needs one)",
    )
    return parser.parse_args()


def record(item: str, ok: bool | None, why: str) -> None:
    verdict = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    RESULTS.append((item, verdict, why))
    print(f"[{item}] {verdict}: {why}", flush=True)


# -- part 1: loading and the three modes of the LLM API ----------------------------------


def settings(args: argparse.Namespace) -> TrtllmSettings:
    return TrtllmSettings(
        model=args.model,
        max_batch_size=args.max_batch_size,
        kv_cache_fraction=args.kv_cache_fraction,
        kv_cache_tokens=args.kv_cache_tokens,
        guided_decoding_backend=None
        if args.guided_decoding_backend == "none"
        else args.guided_decoding_backend,
    )


def load(args: argparse.Namespace) -> tuple[Any, threading.Thread]:
    """Build the LLM as the gateway would: by default through the adapter's start(), which
    builds it on a worker thread; with --load-on-main-thread here, on the main thread."""
    began = time.perf_counter()
    if args.load_on_main_thread:
        llm, builder = build_llm(settings(args)), threading.current_thread()
    else:
        engine = TrtllmEngine(settings(args))
        asyncio.run(engine.start())
        llm, builder = engine.llm, engine.built_on
        assert builder is not None
    print(f"loaded {args.model} in {time.perf_counter() - began:.1f}s on thread {builder.name!r}")
    return llm, builder


def chat_prompt(llm: Any, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    prompt: str = llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return prompt


def sampling(max_tokens: int) -> Any:
    from tensorrt_llm import SamplingParams

    # Explicit: the defaults are max_tokens=32 and greedy decoding. The template holds BOS.
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=1, add_special_tokens=False
    )


def report(label: str, outputs: list[Any], seconds: float) -> None:
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{label}] {len(outputs)} prompts, {tokens} tokens in {seconds:.2f}s", end="")
    print(f" = {tokens / seconds:.0f} tokens/s")
    for out in outputs:
        print(f"    {out.outputs[0].text.strip()[:90]!r} ({out.outputs[0].finish_reason})")


def sync_mode(llm: Any, args: argparse.Namespace) -> None:
    # Called with no event loop running: generate() then uses its blocking queues.
    prompts = [chat_prompt(llm, q) for q in QUESTIONS]
    began = time.perf_counter()
    outputs = llm.generate(prompts, sampling(args.max_tokens), use_tqdm=False)
    report("sync llm.generate", outputs, time.perf_counter() - began)


async def gather_mode(llm: Any, args: argparse.Namespace) -> None:
    prompts = [chat_prompt(llm, q) for q in QUESTIONS]
    began = time.perf_counter()
    # generate_async is called here, inside the running loop, and each RequestOutput awaited.
    outputs = await asyncio.gather(
        *(llm.generate_async(p, sampling(args.max_tokens)) for p in prompts)
    )
    report("async gather", list(outputs), time.perf_counter() - began)


async def streaming_mode(llm: Any, args: argparse.Namespace) -> None:
    prompt = chat_prompt(llm, QUESTIONS[0])
    began = time.perf_counter()
    first: float | None = None
    print("[async streaming] ", end="", flush=True)
    request_output = llm.generate_async(prompt, sampling(args.max_tokens), streaming=True)
    async for out in request_output:
        if first is None and out.outputs[0].text_diff:
            first = time.perf_counter() - began
        print(out.outputs[0].text_diff, end="", flush=True)
    total = time.perf_counter() - began
    tokens = len(out.outputs[0].token_ids)
    print(f"\n    first text after {(first or total) * 1000:.0f} ms, {tokens} tokens", end="")
    print(f" in {total:.2f}s ({out.outputs[0].finish_reason})")


# -- part 2: the gateway on the same LLM, over a real socket -----------------------------


async def send(ws: ClientConnection, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def next_event(ws: ClientConnection, *types: str, errors: bool = False) -> dict[str, Any]:
    """The next event of one of ``types``; an error event raises unless ``errors``."""
    while True:
        event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if event["type"] == "error" and not errors:
            raise RuntimeError(f"gateway error: {event['error']}")
        if not types or event["type"] in types:
            return event


async def say(ws: ClientConnection, text: str, role: str = "user") -> None:
    part = "output_text" if role == "assistant" else "input_text"
    await send(
        ws,
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": role, "content": [{"type": part, "text": text}]},
        },
    )
    await next_event(ws, "conversation.item.done")


async def answer(ws: ClientConnection, **response: Any) -> tuple[dict[str, Any], list[str]]:
    """response.create; the response.done and the codes of the error events before it."""
    await send(ws, {"type": "response.create", "response": response})
    codes = []
    while True:
        event = await next_event(ws, "response.done", "error", errors=True)
        if event["type"] == "error":
            codes.append(event["error"].get("code") or "")
            continue
        return event, codes


async def full_turn(ws: ClientConnection) -> None:
    await say(ws, QUESTIONS[2])
    began = time.perf_counter()
    await send(ws, {"type": "response.create"})
    first: float | None = None
    while True:
        event = await next_event(ws, "response.output_text.delta", "response.done")
        now = time.perf_counter()
        if event["type"] == "response.output_text.delta":
            first = first or now
            continue
        usage = event["response"]["usage"]
        status = event["response"]["status"]
        break
    first = first or now
    rate = usage["output_tokens"] / max(now - first, 1e-9)
    print(f"[gateway] full answer: {status}, first token after {(first - began) * 1000:.0f} ms,")
    print(f"    {usage['output_tokens']} tokens at {rate:.0f} tokens/s, usage {usage}")


async def cancelled_turn(ws: ClientConnection, gateway: Gateway, cancel_after: int) -> None:
    await say(ws, LONG_ASK)
    await send(ws, {"type": "response.create", "response": {"max_output_tokens": 1024}})
    seen = 0
    while seen < cancel_after:
        event = await next_event(ws, "response.output_text.delta", "response.done")
        if event["type"] == "response.done":
            print("[gateway] the answer ended before the cancel; raise --max-tokens")
            return
        seen += 1
    cancel_at = time.perf_counter()
    await send(ws, {"type": "response.cancel"})
    late = 0
    while True:
        event = await next_event(ws, "response.output_text.delta", "response.done")
        if event["type"] == "response.done":
            break
        late += 1
    latency = (time.perf_counter() - cancel_at) * 1000
    status = event["response"]["status"]
    print(f"[gateway] cancel after {seen} deltas: {status} {latency:.1f} ms after the cancel,")
    print(f"    {late} delta frames in flight, engine running now: {gateway.scheduler.running}")


# -- part 3: issue 14's GPU checks -------------------------------------------------------


def filler(llm: Any, tokens: int) -> str:
    """Text of about ``tokens`` tokens for this tokenizer."""
    per_word = max(1, len(llm.tokenizer.encode(" hello" * 8, add_special_tokens=False)) // 8)
    return "hello " * (tokens // per_word)


async def check_context(engine: TrtllmEngine, url: str) -> None:
    """Item 1: the limit the adapter derived against the one TensorRT-LLM enforces."""
    from tensorrt_llm import SamplingParams

    llm, context = engine.llm, engine.context
    print(f"[item 1] the adapter assumes {context.tokens} tokens, from {context.source}")
    max_num_tokens = int(getattr(llm.args, "max_num_tokens", None) or 2 * context.tokens)
    probe_len = min(max_num_tokens, 2 * context.tokens)
    word = llm.tokenizer.encode("hello", add_special_tokens=False)[-1]
    refusal = None
    try:
        output = llm.generate_async([word] * probe_len, SamplingParams(max_tokens=1))
        await output.aresult()
    except Exception as exc:  # the RequestError from the worker's admission
        refusal = str(exc)
    worker = _worker_limit(refusal)
    async with connect(url, subprotocols=[Subprotocol("realtime")]) as ws:
        await next_event(ws, "session.created")
        await say(ws, filler(llm, context.tokens))  # an old turn as long as the window
        await say(ws, "Thanks.", role="assistant")
        await say(ws, "Now say hello in one word.")
        trimmed, trimmed_errors = await answer(ws, max_output_tokens=16)
    async with connect(url, subprotocols=[Subprotocol("realtime")]) as ws:
        await next_event(ws, "session.created")
        await say(ws, filler(llm, context.tokens + 200))
        _, oversized_errors = await answer(ws, max_output_tokens=16)
    problems = []
    if refusal is None:
        problems.append(f"the worker accepted a {probe_len}-token prompt")
    elif worker is None:
        problems.append(f"the worker's refusal does not name its limit: {refusal[:200]!r}")
    elif worker < engine.context.tokens:
        problems.append(f"the worker's limit {worker} < the adapter's {engine.context.tokens}")
    if trimmed["response"]["status"] not in ("completed", "incomplete"):
        problems.append(f"the long conversation was not answered: {trimmed_errors}")
    if oversized_errors != ["context_length_exceeded"]:
        problems.append(f"the oversized message gave {oversized_errors}")
    summary = (
        f"adapter {engine.context.tokens} tokens ({engine.context.source}), worker limit "
        f"{worker}; long conversation {trimmed['response']['status']}, oversized message "
        f"{oversized_errors}"
    )
    record("item 1", not problems, "; ".join(problems) or summary)


async def check_continuation(engine: TrtllmEngine) -> None:
    """Issue 31: a greedy answer continued from its first half's token ids (as a takeover
    does, from the store's log) goes on as the uninterrupted answer did."""
    from dataclasses import replace

    from gateway.engines.base import Finished, GenerationRequest, Message, SamplingParams
    from gateway.engines.base import TextDelta as Delta

    ask = GenerationRequest(
        "smoke-continuation",
        (Message("user", LONG_ASK),),
        SamplingParams(max_output_tokens=64, temperature=0.0),
    )

    async def run(request: GenerationRequest) -> tuple[list[Delta], Finished | None]:
        events = [e async for e in engine.stream(request)]
        ends = [e for e in events if isinstance(e, Finished)]
        return [e for e in events if isinstance(e, Delta)], ends[0] if ends else None

    whole, whole_end = await run(ask)
    half = whole[: len(whole) // 2]
    sent = "".join(d.text for d in half)
    ids = tuple(i for d in half for i in d.token_ids)
    rest, end = await run(replace(ask, continuation=sent, continuation_token_ids=ids))
    expected = "".join(d.text for d in whole)
    got = sent + "".join(d.text for d in rest)
    same = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    ok = got == expected and end is not None and whole_end is not None
    ok = ok and end.usage.output_tokens == whole_end.usage.output_tokens  # type: ignore[union-attr]
    why = (
        f"{len(ids)} token ids sent back after the prompt's; the continued answer "
        + ("equals the uninterrupted one" if got == expected else f"differs from char {same}")
        + f"; output tokens {end.usage.output_tokens if end else None} against "
        + f"{whole_end.usage.output_tokens if whole_end else None}"
    )
    record("issue 31", ok, why)


async def check_guided(engine: TrtllmEngine) -> None:
    """Issue 38: answers under guided decoding hold to what they were asked for."""
    from gateway.engines import grammars
    from gateway.engines.base import (
        Constraint,
        EngineError,
        Finished,
        GenerationRequest,
        Message,
        SamplingParams,
        TextDelta,
        Tool,
        ToolCallDelta,
    )

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        "required": ["city", "population", "landmarks"],
    }
    patch = 'start: "*** Begin Patch\\n" LINE+ "*** End Patch"\nLINE: /[+-][^\\n]*\\n/\n'
    weather = Tool("get_weather", "The weather in a city.", schema)
    custom = Tool("apply_patch", "Edit files.", freeform=True, grammar=Constraint("lark", patch))
    sampling = SamplingParams(max_output_tokens=160, temperature=0.0)
    ask = (Message("user", "Describe Paris as JSON."),)
    cases = {
        "json schema": GenerationRequest(
            "g1", ask, sampling, constraint=Constraint("json_schema", json.dumps(schema), "city")
        ),
        "required tool": GenerationRequest(
            "g2", ask, sampling, tools=(weather,), tool_choice="required"
        ),
        "custom tool grammar": GenerationRequest(
            "g3", (Message("user", "Add a line hello."),), sampling, tools=(custom,),
            tool_choice="apply_patch",
        ),
    }  # fmt: skip
    failures: list[str] = []
    for label, request in cases.items():
        try:
            engine.check(request)
            events = [e async for e in engine.stream(request)]
        except EngineError as exc:
            failures.append(f"{label}: {exc.code} {exc.message}")
            continue
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        args = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
        end = events[-1]
        if not isinstance(end, Finished) or end.reason not in ("stop", "tool_calls"):
            failures.append(f"{label}: ended {end!r}")
            continue
        lenient = Constraint("json_schema", json.dumps(schema))
        if label == "json schema":
            held = grammars.accepts(grammars.grammar(lenient, lenient=True), text.strip())
        elif label == "required tool":
            held = grammars.accepts(grammars.grammar(lenient, lenient=True), args)
        else:
            given = json.loads(args)["input"]
            held = grammars.accepts(grammars.grammar(Constraint("lark", patch)), given)
        if not held:
            failures.append(f"{label}: {(text or args)[:120]!r} does not hold")
    backend = engine.settings.guided_decoding_backend
    record(
        "issue 38 structured",
        not failures,
        f"backend {backend}: " + ("; ".join(failures) or "all three answers held"),
    )


async def check_logprobs(engine: TrtllmEngine, http: str) -> None:
    """Issue 38: the real API's log probabilities, and the adapter's reading of them."""
    from tensorrt_llm import SamplingParams as TrtSampling

    from gateway.engines.base import Finished, GenerationRequest, Message, PromptLogprobs
    from gateway.engines.base import SamplingParams as Sampling
    from gateway.engines.base import TextDelta as Delta

    llm = engine.llm
    raw = llm.generate_async(
        chat_prompt(llm, QUESTIONS[1]),
        TrtSampling(max_tokens=4, temperature=0.0, logprobs=20, prompt_logprobs=20),
        streaming=True,
    )
    shapes = []
    async for out in raw:
        c = out.outputs[0]
        first = c.logprobs_diff[0] if c.logprobs_diff else None
        shapes.append(
            f"{len(c.token_ids_diff)} ids, logprobs_diff {len(c.logprobs_diff)} of "
            f"{type(first).__name__} ({len(first) if isinstance(first, dict) else '-'} entries), "
            f"prompt_logprobs {len(c.prompt_logprobs or [])} for {len(out.prompt_token_ids)} "
            "prompt tokens"
        )
    print("[issue 38] TensorRT-LLM's own outputs: " + " | ".join(shapes))
    ask = GenerationRequest(
        "smoke-logprobs",
        (Message("user", QUESTIONS[1]),),
        Sampling(max_output_tokens=24, temperature=0.0, logprobs=3, prompt_logprobs=1),
    )
    events = [e async for e in engine.stream(ask)]
    deltas = [e for e in events if isinstance(e, Delta)]
    prompts = [e for e in events if isinstance(e, PromptLogprobs)]
    end = next((e for e in events if isinstance(e, Finished)), None)
    logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    text = "".join(d.text for d in deltas)
    problems = []
    if not deltas or any(d.logprobs is None for d in deltas):
        problems.append("a text delta without log probabilities")
    if end is None or len(logprobs) != end.usage.output_tokens:
        problems.append(f"{len(logprobs)} log probabilities for {end and end.usage.output_tokens}")
    if "".join(lp.token for lp in logprobs) != text:
        problems.append(f"their tokens read {''.join(lp.token for lp in logprobs)[:60]!r}")
    if any(len(lp.top) != 3 or abs(lp.top[0].logprob - lp.logprob) > 1e-3 for lp in logprobs):
        problems.append("a greedy token that is not its position's likeliest, or not 3 others")
    if len(prompts) != 1 or events.index(prompts[0]) > events.index(deltas[0] if deltas else end):
        problems.append("the prompt's log probabilities did not come once, first")
    elif end is not None and len(prompts[0].tokens) != end.usage.input_tokens - 1:
        problems.append(f"{len(prompts[0].tokens)} prompt entries for {end.usage.input_tokens}")
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "logprobs": True}
    chat = await asyncio.to_thread(_post, f"{http}/v1/chat/completions", {**body, "max_tokens": 8})
    content = ((chat.get("choices") or [{}])[0].get("logprobs") or {}).get("content")
    if not content:
        problems.append(f"Chat Completions answered {str(chat)[:200]}")
    why = "; ".join(problems) or (
        f"{len(logprobs)} tokens' log probabilities (first {logprobs[0].token!r} "
        f"{logprobs[0].logprob:.3f}), the prompt's {len(prompts[0].tokens)} first, "
        f"Chat Completions {len(content or [])} entries"
    )
    record("issue 38", not problems, why)


async def check_completions(engine: TrtllmEngine, http: str) -> None:
    """Issue 39: a raw prompt (no chat template) through ``POST /v1/completions`` equals
    ``generate_async`` on that prompt string, greedy; token ids give the same answer; an
    echo with logprobs and max_tokens 0 scores the prompt's own tokens."""
    from tensorrt_llm import SamplingParams as TrtSampling

    llm, prompt = engine.llm, "The capital of France is"
    direct = llm.generate_async(prompt, TrtSampling(max_tokens=8, temperature=0.0))
    expected = (await direct.aresult()).outputs[0].text
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    text_answer = await asyncio.to_thread(_post, f"{http}/v1/completions", body)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
    ids_answer = await asyncio.to_thread(_post, f"{http}/v1/completions", {**body, "prompt": ids})
    score = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    scored = await asyncio.to_thread(_post, f"{http}/v1/completions", score)
    problems = []
    got = [((a.get("choices") or [{}])[0]).get("text") for a in (text_answer, ids_answer)]
    if got != [expected, expected]:
        problems.append(f"generate_async said {expected!r}; the route said {got}")
    choice = (scored.get("choices") or [{}])[0]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if choice.get("text") != prompt or len(tokens) != len(ids):
        problems.append(f"the echo answered {str(scored)[:200]}")
    why = "; ".join(problems) or f"{expected!r} from text and from {len(ids)} token ids alike"
    record("issue 39", not problems, why)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as error:
        answer = json.loads(error.read())
    return answer


def _worker_limit(refusal: str | None) -> int | None:
    import re

    found = re.search(r"max_seq_len \((\d+)\)", refusal or "")
    return int(found.group(1)) if found else None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children...), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


async def check_crash(engine: TrtllmEngine, gateway: Gateway, url: str, http: str) -> None:
    """Item 3: kill the worker mid-answer; the answer, /readyz and the loop must all cope."""
    workers = descendants(os.getpid())
    if not workers:
        record("item 3", None, "no worker process to kill (the executor runs in this process)")
        return
    stall = 0.0

    async def heartbeat() -> None:
        nonlocal stall
        while True:
            began = time.perf_counter()
            await asyncio.sleep(0.01)
            stall = max(stall, time.perf_counter() - began - 0.01)

    beat = asyncio.create_task(heartbeat())
    try:
        async with connect(url, subprotocols=[Subprotocol("realtime")]) as ws:
            await next_event(ws, "session.created")
            await say(ws, LONG_ASK)
            await send(ws, {"type": "response.create", "response": {"max_output_tokens": 1024}})
            await next_event(ws, "response.output_text.delta")
            killed_at = time.perf_counter()
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            print(f"[item 3] killed worker processes {workers} mid-answer")
            try:
                done = await asyncio.wait_for(
                    next_event(ws, "response.done", errors=True), CRASH_DEADLINE_S
                )
            except TimeoutError:
                done = None
            took = time.perf_counter() - killed_at
        readyz = await asyncio.to_thread(_status, f"{http}/readyz")
    finally:
        beat.cancel()
    problems = []
    if done is None:
        problems.append(f"the live answer did not end within {CRASH_DEADLINE_S:.0f}s")
    else:
        error = done["response"].get("status_details", {}).get("error", {})
        if (done["response"]["status"], error.get("code")) != ("failed", "engine_unavailable"):
            problems.append(f"the live answer ended {done['response']['status']} {error}")
    if readyz != 503:
        problems.append(f"/readyz answered {readyz}")
    if stall > MAX_LOOP_STALL_S:
        problems.append(f"the event loop stalled for {stall:.2f}s")
    if not gateway.engine_failed.is_set():
        problems.append("the gateway was not told (engine_failed is not set)")
    why = "; ".join(problems) or (
        f"the answer failed with engine_unavailable {took:.1f}s after the kill, /readyz 503, "
        f"longest loop stall {stall * 1000:.0f} ms, failure: {engine.failure}"
    )
    record("item 3", not problems, why)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


async def gateway_mode(llm: Any, args: argparse.Namespace, builder: threading.Thread) -> None:
    engine = TrtllmEngine(settings(args), llm=llm)  # the LLM loaded above, on a new loop
    gateway = Gateway(engine, GatewayConfig(host="127.0.0.1", port=0))
    await gateway.start()
    try:
        await gateway.wait_ready()
        base = f"127.0.0.1:{gateway.port}"
        url = f"ws://{base}/v1/realtime"
        async with connect(url, subprotocols=[Subprotocol("realtime")]) as ws:
            await next_event(ws, "session.created")
            await send(
                ws,
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "output_modalities": ["text"],
                        "max_output_tokens": args.max_tokens * 2,
                        "temperature": 0.7,
                    },
                },
            )
            await next_event(ws, "session.updated")
            await full_turn(ws)
            await cancelled_turn(ws, gateway, args.cancel_after)
        where = "the main thread" if builder is threading.main_thread() else "a worker thread"
        record(
            "item 10",
            True,
            f"the LLM was built on {where} ({builder.name!r}) and served every answer above",
        )
        await check_context(engine, url)
        await check_continuation(engine)
        await check_guided(engine)
        await check_logprobs(engine, f"http://{base}")
        await check_completions(engine, f"http://{base}")
        if args.skip_crash:
            record("item 3", None, "--skip-crash")
        else:
            await check_crash(engine, gateway, url, f"http://{base}")
    finally:
        await gateway.stop()  # also shuts the LLM down


async def async_modes(llm: Any, args: argparse.Namespace, builder: threading.Thread) -> None:
    await gather_mode(llm, args)
    await streaming_mode(llm, args)
    await gateway_mode(llm, args, builder)


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        llm, builder = load(args)  # its loop is gone now: the LLM must not depend on it
    except Exception as exc:
        record("item 10", False, f"building the LLM failed: {exc!r}; retry --load-on-main-thread")
        return 1
    sync_mode(llm, args)  # no loop running here, as llm.generate expects
    asyncio.run(async_modes(llm, args, builder))
    print("summary: " + ", ".join(f"{item} {verdict}" for item, verdict, _ in RESULTS))
    return 1 if any(verdict == "FAIL" for _, verdict, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
