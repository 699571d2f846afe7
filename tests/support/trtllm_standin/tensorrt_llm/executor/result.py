"""STAND-IN for ``tensorrt_llm.executor.result`` (tests only): ``Logprob`` and the shape of
the log probabilities a ``CompletionOutput`` carries, as in the real executor/result.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(slots=True)
class Logprob:
    """A token's log probability and its rank in the model's distribution (1: likeliest)."""

    logprob: float
    rank: int | None = None


# One dict per position: token id -> Logprob, for the top ``logprobs`` tokens there.
TokenLogprobs: TypeAlias = list[dict[int, Logprob]]
