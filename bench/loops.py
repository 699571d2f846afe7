"""How often the bundled model's answers loop, for candidate sampling defaults.

    python -m bench.loops [--candidates greedy,default] [--pairs 32] [--tokens 256] [--threads 1]

Every candidate gets the same run: the gateway in this process on the llama.cpp engine
(the bundled SmolLM2, the candidate as the engine's defaults, so sessions start from it as
in ``make run``), and through ``gateway.client`` one conversation per prompt pair: an
everyday question, then its follow-up in the same conversation, each answer at most
``--tokens`` tokens, four conversations at a time (the engine's four slots). An answer
*loops* when some 6-word sequence appears 3 times or more in it. The factual check asks
"What is the capital of France?" in 12 fresh sessions (seeds 1 to 12) and counts the
answers that name Paris. The loop share and the check are properties of the candidate (same
prompts, seeds and greedy or seeded sampling each run), not of the machine; the seconds
column is the machine's, and on a shared one it is noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import gateway.client
from gateway.config import GatewayConfig
from gateway.engines.base import SamplingParams
from gateway.engines.llamacpp import (
    BUNDLED_SAMPLER,
    BUNDLED_SAMPLING,
    LlamaCppEngine,
    LlamaSampler,
    bundled_model_path,
)
from gateway.server import Gateway

# (question, follow-up): everyday things a newcomer asks first.
PAIRS: tuple[tuple[str, str], ...] = (
    ("What is the capital of France? Then tell me a short story about it.", "And of Korea?"),
    ("What is the capital of France?", "And why?"),
    ("How do I boil an egg?", "And how long for a soft one?"),
    ("Why is the sky blue?", "And why are sunsets red?"),
    ("Give me three tips for sleeping better.", "And why does that help?"),
    ("What should I pack for a weekend at the beach?", "And for the mountains?"),
    ("How do I make a cup of tea?", "And coffee?"),
    ("What is a good name for a black cat?", "And for a dog?"),
    ("Write a short poem about autumn.", "Now one about spring."),
    ("How can I save money on groceries?", "And why does that work?"),
    ("What is photosynthesis?", "And why do plants need it?"),
    ("Tell me a joke.", "Another one, please."),
    ("How do I start running as a beginner?", "And how often should I run?"),
    ("What is the difference between a virus and a bacterium?", "And why does it matter?"),
    ("Suggest a simple dinner recipe.", "And a dessert to go with it?"),
    ("How do I write a polite email to my boss asking for a day off?", "And a shorter one?"),
    ("What are the planets of the solar system?", "And which one is the biggest?"),
    ("Why do cats purr?", "And why do dogs wag their tails?"),
    ("How do I learn a new language quickly?", "And why is that effective?"),
    ("What is the water cycle?", "And why is it important?"),
    ("Tell me a short story about a robot.", "And what happens next?"),
    ("How do I clean a stain off a white shirt?", "And a red wine stain?"),
    ("What is a healthy breakfast?", "And why is breakfast important?"),
    ("Explain what a computer does, simply.", "And what is a program?"),
    ("How do I keep a houseplant alive?", "And how often should I water it?"),
    ("What is the tallest mountain in the world?", "And how tall is it?"),
    ("Give me ideas for a rainy day.", "And for a sunny day?"),
    ("How do airplanes fly?", "And why don't they fall?"),
    ("What is a good way to study for an exam?", "And the night before?"),
    ("Describe a dog in three sentences.", "Now a cat."),
    ("What is the boiling point of water?", "And why does it change on a mountain?"),
    ("How can I be more productive at work?", "And at home?"),
)
FRANCE = "What is the capital of France?"
FACT_TRIES = 12
NGRAM = 6
LOOP_REPEATS = 3


@dataclass(frozen=True)
class Candidate:
    name: str
    sampling: SamplingParams
    sampler: LlamaSampler = field(default_factory=LlamaSampler)


# What was tried (docs/llamacpp.md has the table). "greedy" is the old default;
# "default" is whatever the engine's bundled defaults are now. llama.cpp looks back 64
# tokens for repeats unless told otherwise ("/2048": the whole 2048-token context).
GREEDY = SamplingParams(temperature=0.0)
WHOLE = 2048
CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("greedy", GREEDY),
        Candidate("default", BUNDLED_SAMPLING, BUNDLED_SAMPLER),
        Candidate(
            "freq0.3/256", replace(GREEDY, frequency_penalty=0.3), LlamaSampler(repeat_last_n=256)
        ),
        Candidate("dry0.8", GREEDY, LlamaSampler(dry_multiplier=0.8)),
        Candidate(
            "dry0.8/2048", GREEDY, LlamaSampler(dry_multiplier=0.8, dry_penalty_last_n=WHOLE)
        ),
        Candidate(
            "dry0.8/2048+freq0.3",
            replace(GREEDY, frequency_penalty=0.3),
            LlamaSampler(dry_multiplier=0.8, dry_penalty_last_n=WHOLE),
        ),
        Candidate(
            "dry0.8/2048+freq0.3/256",
            replace(GREEDY, frequency_penalty=0.3),
            LlamaSampler(dry_multiplier=0.8, dry_penalty_last_n=WHOLE, repeat_last_n=256),
        ),
        Candidate(
            "dry0.8/2048+pres0.5/256",
            replace(GREEDY, presence_penalty=0.5),
            LlamaSampler(dry_multiplier=0.8, dry_penalty_last_n=WHOLE, repeat_last_n=256),
        ),
    )
}


def words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.lower())


def most_repeated(text: str, n: int = NGRAM) -> int:
    """How many times the most frequent ``n``-word sequence occurs in ``text`` (0: too short)."""
    w = words(text)
    grams = Counter(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
    return max(grams.values(), default=0)


def loops(text: str) -> bool:
    return most_repeated(text) >= LOOP_REPEATS


@dataclass
class Result:
    name: str
    firsts: list[str]
    follow_ups: list[str]
    paris: int
    seconds: float
    tokens: int

    def share(self, answers: Sequence[str]) -> float:
        return sum(map(loops, answers)) / len(answers)


async def _conversation(
    url: str, index: int, pair: tuple[str, str], tokens: int, limit: asyncio.Semaphore
) -> tuple[str, str, int]:
    # A seed of its own (only a candidate that samples uses it): the same answers every run.
    connecting = gateway.client.connect(url, max_output_tokens=tokens, seed=index + 1, timeout=300)
    async with limit, connecting as chat:
        first = await chat.ask(pair[0])
        then = await chat.ask(pair[1])
    used = sum(r.usage.output_tokens for r in (first, then) if r.usage is not None)
    return first.text, then.text, used


async def _fact(url: str, seed: int, limit: asyncio.Semaphore) -> bool:
    async with limit, gateway.client.connect(url, max_output_tokens=48, seed=seed) as chat:
        return "Paris" in (await chat.ask(FRANCE)).text


async def run_candidate(
    candidate: Candidate, pairs: Sequence[tuple[str, str]], tokens: int, threads: int | None
) -> Result:
    engine = LlamaCppEngine(
        bundled_model_path(),
        threads=threads,
        sampling=candidate.sampling,
        sampler=candidate.sampler,
    )
    server = Gateway(engine, GatewayConfig(port=0))
    await server.start()
    try:
        await server.wait_ready()
        url = f"ws://127.0.0.1:{server.port}/v1/realtime"
        limit = asyncio.Semaphore(engine.capacity)
        began = time.perf_counter()
        answers = await asyncio.gather(
            *(_conversation(url, i, p, tokens, limit) for i, p in enumerate(pairs))
        )
        seconds = time.perf_counter() - began
        facts = await asyncio.gather(*(_fact(url, s, limit) for s in range(1, FACT_TRIES + 1)))
    finally:
        await server.stop()
    return Result(
        candidate.name,
        [a[0] for a in answers],
        [a[1] for a in answers],
        sum(facts),
        seconds,
        sum(a[2] for a in answers),
    )


def row(r: Result) -> str:
    both = r.firsts + r.follow_ups
    worst = max(most_repeated(t) for t in both)
    return (
        f"| {r.name} | {r.share(both):.0%} | {r.share(r.firsts):.0%} | {r.share(r.follow_ups):.0%}"
        f" | {worst} | {r.paris}/{FACT_TRIES} | {r.tokens / len(both):.0f} | {r.seconds:.0f} |"
    )


def dump(path: Path, answers: dict[str, list[list[str]]]) -> None:
    """Every answer, by candidate, as [first answer, follow-up] per prompt pair."""
    path.write_text(json.dumps(answers, indent=1, ensure_ascii=False))


HEADER = (
    "| candidate | answers looping | first answers | follow-ups | worst repeat | Paris"
    " | tokens/answer | seconds |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", default="greedy,default", help=", ".join(CANDIDATES))
    parser.add_argument("--pairs", type=int, default=len(PAIRS))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--show", action="store_true", help="print every looping answer")
    parser.add_argument("--dump", metavar="FILE.json", help="write every answer there")
    args = parser.parse_args()
    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown candidate(s) {unknown}; known: {', '.join(CANDIDATES)}")
    pairs = PAIRS[: args.pairs]
    print(f"{len(pairs)} prompt pairs, {args.tokens}-token answers, {args.threads} thread(s)")
    print(HEADER, flush=True)
    answers: dict[str, list[list[str]]] = {}
    for name in names:
        result = await run_candidate(CANDIDATES[name], pairs, args.tokens, args.threads)
        print(row(result), flush=True)
        answers[name] = [list(a) for a in zip(result.firsts, result.follow_ups, strict=True)]
        if args.dump:
            dump(Path(args.dump), answers)
        if args.show:
            for text in result.firsts + result.follow_ups:
                if loops(text):
                    print(f"    looped ×{most_repeated(text)}: {text[:300]!r}")


if __name__ == "__main__":
    asyncio.run(main())
