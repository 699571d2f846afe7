"""What structured output costs on the bundled model: a schema-constrained answer beside the
same answer unconstrained, and a grammar's first compile beside a cached one.

    python -m bench.structured [--rounds 3] [--tokens 64] [--threads 1]

The llamacpp engine runs in this process (one slot, so the answers do not share steps).
Each round runs, in turn, one answer to the same prompt without a constraint and under a
JSON Schema whose one string holds the answer (``maxLength`` large: both run to the same
budget), and reports for each the wall time and this process's CPU time (llama.cpp's
threads are this process's) per generated token, and the time to the first token. Then:
the gateway's compile check of a schema's grammar (gateway/engines/grammars.py) on first
sight and from its cache, and the same for Codex's ``apply_patch`` grammar as a custom
tool's (the tool-call grammar, tests/test_structured_llamacpp.py reads it from the pinned
Codex CLI) when it is installed. Writes bench/results/structured.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from gateway.engines import grammars, tool_format
from gateway.engines.base import (
    Constraint,
    Finished,
    GenerationRequest,
    Message,
    SamplingParams,
    TextDelta,
    Tool,
)
from gateway.engines.driver import EngineDriver
from gateway.engines.llamacpp import BUNDLED_SAMPLING, LlamaCppEngine, bundled_model_path

RESULTS = Path(__file__).resolve().parent / "results" / "structured.md"
CODEX = (
    Path(__file__).resolve().parent.parent
    / "tests/node/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
)
SYSTEM = Message("system", "You are a helpful assistant.")
PROMPT = Message("user", "Tell me a long story about a lighthouse keeper.")
STORY = {
    "type": "object",
    # minLength: the story runs to the budget, as the unconstrained one does
    "properties": {"story": {"type": "string", "minLength": 1000, "maxLength": 4000}},
    "required": ["story"],
}


def fmt_range(values: list[float], digits: int = 2) -> str:
    """``median (low-high)``."""
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


async def answer(
    driver: EngineDriver, rid: str, tokens: int, constraint: Constraint | None
) -> tuple[float, float, float, int]:
    """(seconds to first token, wall seconds, CPU seconds, tokens) of one answer."""
    sampling = SamplingParams(
        max_output_tokens=tokens,
        temperature=BUNDLED_SAMPLING.temperature,
        frequency_penalty=BUNDLED_SAMPLING.frequency_penalty,
    )
    request = GenerationRequest(rid, (SYSTEM, PROMPT), sampling, constraint=constraint)
    cpu, began = time.process_time(), time.perf_counter()
    first, done = 0.0, None
    async for event in driver.stream(request):
        if isinstance(event, str | TextDelta):
            first = first or time.perf_counter() - began
        elif isinstance(event, Finished):
            done = event
    assert done is not None
    return first, time.perf_counter() - began, time.process_time() - cpu, done.usage.output_tokens


def compile_ms(text: str) -> tuple[float, float]:
    """The compile check of ``text`` on first sight, and from the cache (ms)."""
    grammars.compile_error.cache_clear()
    began = time.perf_counter()
    grammars.compile_error(text)
    cold = time.perf_counter() - began
    began = time.perf_counter()
    grammars.compile_error(text)
    return cold * 1000, (time.perf_counter() - began) * 1000


def patch_tool_grammar() -> str | None:
    if not CODEX.exists():
        return None
    data = CODEX.read_bytes()
    start = data.index(b"start: begin_patch hunk+ end_patch")
    end = data.index(b"%import common.LF", start) + len(b"%import common.LF")
    definition = data[start:end].decode() + "\n"
    tool = Tool("apply_patch", freeform=True, grammar=Constraint("lark", definition, "apply_patch"))
    request = GenerationRequest("r", (PROMPT,), tools=(tool,), tool_choice="apply_patch")
    return tool_format.grammar(request)


async def measure(rounds: int, tokens: int, threads: int) -> str:
    schema = Constraint("json_schema", json.dumps(STORY), "story")
    engine = LlamaCppEngine(bundled_model_path(), ctx=1024, slots=1, threads=threads)
    await engine.start()
    arms: dict[str, list[tuple[float, float, float, int]]] = {"free": [], "schema": []}
    try:
        async with EngineDriver(engine) as driver:
            await answer(driver, "warm", 8, None)  # the prompt's prefix is cached for all
            # llama.cpp sets LLGuidance up (its view of the vocabulary) on first use.
            cold = await answer(driver, "first", tokens, schema)
            for r in range(rounds):
                arms["free"].append(await answer(driver, f"f{r}", tokens, None))
                arms["schema"].append(await answer(driver, f"s{r}", tokens, schema))
    finally:
        await engine.close()
    lines = [
        "# Structured output on the bundled model (bench/structured.py)",
        "",
        f"SmolLM2-135M (llama.cpp, LLGuidance), {threads} thread(s), one slot; the same prompt "
        f"answered to a budget of {tokens} tokens, unconstrained and under a JSON Schema whose "
        f"one string holds the story. {rounds} rounds, alternating; median (range).",
        "",
        "| answer | ms per token | CPU ms per token | first token, ms | tokens |",
        "|---|---|---|---|---|",
    ]
    for arm, label in (("free", "unconstrained (baseline)"), ("schema", "JSON Schema")):
        runs = arms[arm]
        per_token = [wall / n * 1000 for _, wall, _, n in runs]
        cpu = [c / n * 1000 for _, _, c, n in runs]
        first = [f * 1000 for f, _, _, _ in runs]
        lines.append(
            f"| {label} | {fmt_range(per_token)} | {fmt_range(cpu)} | {fmt_range(first)} | "
            f"{statistics.median(n for *_, n in runs):.0f} |"
        )
    lines.append(
        f"| JSON Schema, the first constrained request after the engine started | "
        f"{cold[1] / cold[3] * 1000:.2f} | {cold[2] / cold[3] * 1000:.2f} | "
        f"{cold[0] * 1000:.2f} | {cold[3]} |"
    )
    lines += [
        "",
        "The gateway's compile check of a grammar (LLGuidance, before the engine sees it), "
        f"{rounds} rounds, ms:",
        "",
        "| grammar | first request | cached |",
        "|---|---|---|",
    ]
    checks = {"the story schema": grammars.grammar(schema)}
    patch = patch_tool_grammar()
    if patch is not None:
        checks["Codex's apply_patch as a custom tool"] = patch
    for label, text in checks.items():
        times = [compile_ms(text) for _ in range(rounds)]
        lines.append(
            f"| {label} | {fmt_range([c for c, _ in times])} | "
            f"{fmt_range([w for _, w in times], digits=4)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    report = asyncio.run(measure(args.rounds, args.tokens, args.threads))
    RESULTS.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
