"""STAND-IN for ``tensorrt_llm.sampling_params`` (tests only).

A subset of the real fields, with the real names, defaults and validation
(tensorrt_llm/sampling_params.py): keyword-only and slotted, so a misspelt or invented
field fails loudly; ``top_p`` outside [0, 1], ``top_k < 0`` or ``temperature < 0`` is a
``ValueError`` at construction. The seed is checked where the real one is: by the worker,
which fails the request when it is not an unsigned 64-bit integer. ``logprobs`` and
``prompt_logprobs`` are taken as the real ``_validate`` takes them (``x and int(x)``: 0 and
None ask for nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    """The real class's fields (tensorrt_llm/sampling_params.py): only one guide may be
    set, which ``SamplingParams`` checks at construction."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        num_guides = sum(bool(getattr(self, f.name)) for f in fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32  # the real default: short answers unless the caller says otherwise
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    _stop_word_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    # None everywhere means greedy decoding, as documented for the real class.
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Keep in sync with tllme.OutputConfig, as the real class says.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        self._validate()

    def _validate(self) -> None:
        if self.top_p is not None and (self.top_p < 0 or self.top_p > 1):
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        # As the real one: logprobs=True asks for the top-1; 0 and None for nothing.
        self.logprobs = self.logprobs and int(self.logprobs)
        self.prompt_logprobs = self.prompt_logprobs and int(self.prompt_logprobs)

    @staticmethod
    def params_imply_greedy_decoding(
        *, temperature: float | None, top_p: float | None, top_k: int | None
    ) -> bool:
        return (
            (temperature is None and top_p is None and top_k is None)
            or top_k == 1
            or top_p == 0.0
            or temperature == 0
        )

    def _setup(
        self,
        tokenizer: Any,
        hf_model_config: Any = None,
        generation_config: Any = None,
        add_special_tokens: bool = False,
    ) -> SamplingParams:
        """Called by ``generate_async`` when ``end_id`` is unset, as in the real LLM."""
        if self.end_id is None:
            self.end_id = tokenizer.eos_token_id
            self.pad_id = tokenizer.pad_token_id
            if self.pad_id is None:
                self.pad_id = self.end_id
        if self.stop is not None:
            strs = [self.stop] if isinstance(self.stop, str) else self.stop
            self._stop_word_ids = [
                tokenizer.encode(s, add_special_tokens=add_special_tokens) for s in strs
            ]
        return self

    def _get_stop_words(self) -> list[list[int]]:
        words = [[i] for i in self.stop_token_ids] if self.stop_token_ids else []
        if self.stop is None:
            return words
        if self._stop_word_ids is None:
            raise RuntimeError(
                f"{self.__class__.__name__}.stop ({self.stop}) is not processed by tokenizer, "
                "please call the setup method."
            )
        return words + self._stop_word_ids

    def _get_stop_reasons_and_words(self) -> list[tuple[str | int, list[int]]]:
        reasons: list[str | int] = list(self.stop_token_ids or [])
        if self.stop is not None:
            reasons += [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return list(zip(reasons, self._get_stop_words(), strict=False))
