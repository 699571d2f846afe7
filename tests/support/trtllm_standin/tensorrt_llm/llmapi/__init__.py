"""STAND-IN for ``tensorrt_llm.llmapi`` (tests only; see ../../README.md).

Same names, signatures and observable behaviour as the real LLM API in the parts the
gateway uses; the "model" is a scripted reply from ``tensorrt_llm._standin.controls``.
Each behaviour names the real file it follows (TensorRT-LLM 1.2-era).
"""

from __future__ import annotations

import asyncio
import itertools
import queue as queue_mod
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tensorrt_llm import _standin
from tensorrt_llm._standin import RequestError
from tensorrt_llm.executor.result import TokenLogprobs
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]

# Keyword arguments the stand-in accepts; the real LLM validates against its TorchLlmArgs
# fields and raises ValueError("LLM got invalid argument: ...") for anything else.
_VALID_KWARGS = {
    "backend",
    "kv_cache_config",
    "max_batch_size",
    "max_num_tokens",
    "max_seq_len",
    "max_beam_width",
    "enable_chunked_prefill",
    "pipeline_parallel_size",
    "stream_interval",
    "guided_decoding_backend",
}
# llmapi/llm_args.py: guided_decoding_backend: Optional[Literal["xgrammar", "llguidance"]]
_GUIDED_BACKENDS = (None, "xgrammar", "llguidance")
_ids = itertools.count(1)


@dataclass(kw_only=True)
class KvCacheConfig:
    """Subset of the real pydantic model (llmapi/llm_args.py); unknown fields fail."""

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = 0.9
    host_cache_size: int | None = None
    enable_partial_reuse: bool = True
    tokens_per_block: int = _standin.TOKENS_PER_BLOCK


@dataclass(slots=True)
class CompletionOutput:
    """As executor/result.py's: ``logprobs`` one dict (token id -> Logprob) per generated
    token, the top ``SamplingParams.logprobs`` there; ``prompt_logprobs`` one per prompt
    position (position t's predicts token t + 1)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: TokenLogprobs = field(default_factory=list)
    prompt_logprobs: TokenLogprobs = field(default_factory=list)
    finish_reason: str | None = None  # 'stop' | 'length' | 'timeout' | 'cancelled'
    stop_reason: int | str | None = None
    _last_text_len: int = field(default=0, repr=False)
    _last_token_ids_len: int = field(default=0, repr=False)
    _last_logprobs_len: int = field(default=0, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> TokenLogprobs:
        return self.logprobs[self._last_logprobs_len :]


_FINISH_REASONS = {
    "end_id": "stop",
    "stop_words": "stop",
    "length": "length",
    "timeout": "timeout",
    "cancelled": "cancelled",
}


class RequestOutput:
    """The handle generate_async returns; iterating it yields itself, updated in place.

    Mirrors executor/result.py: every response is handled on the thread that iterates
    (the event loop, for streaming), and each handling ends with the executor's
    ``_handle_background_error`` check.
    """

    def __init__(
        self,
        executor: _standin.Executor,
        tokenizer: _standin.StandinTokenizer,
        record: _standin.RequestRecord,
        streaming: bool,
    ) -> None:
        self._executor = executor
        self._tokenizer = tokenizer
        self._record = record
        self._streaming = streaming
        self._sampling = record.sampling_params
        self.request_id = record.request_id
        self.prompt = record.prompt
        self.prompt_token_ids = record.prompt_token_ids
        self.outputs = [CompletionOutput(0)]
        self.cached_tokens = 0
        self._done = False
        self._aborted = False
        # Bound to the loop running now, like the real AsyncQueue/_SyncQueue pair.
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._queue: Any = asyncio.Queue() if self._loop else queue_mod.Queue()
        self._deliver = _standin.make_deliver(self._loop, self._queue)

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Ask the worker to drop the request; returns at once (fire-and-forget)."""
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        self._check_loop()
        self._handle(await self._queue.get())
        return self

    async def aresult(self) -> RequestOutput:
        while not self._done:
            await self.__anext__()
        return self

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self.aresult().__await__()

    def result(self, timeout: float | None = None) -> RequestOutput:
        while not self._done:
            self._handle(self._queue.get(timeout=timeout))
        return self

    def _check_loop(self) -> None:
        if self._loop is None:
            raise RuntimeError(
                "The asyncio event loop was not present during initialization, "
                "so async operations are not available."
            )
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("RequestOutput is bound to a different event loop")

    def _handle(self, item: _standin.Post) -> None:
        if isinstance(item, _standin.ErrorResponse):
            self._executor._handle_background_error(item.message)  # raises RequestError
            return
        new_ids, reason, cached, logprobs, prompt_logprobs = item
        out = self.outputs[0]
        self.cached_tokens = cached
        out._last_token_ids_len = len(out.token_ids)
        out._last_text_len = len(out.text)
        out.token_ids.extend(new_ids)
        # As _handle_sequence: the prompt's replaced, the new tokens' appended.
        if prompt_logprobs is not None:
            out.prompt_logprobs = prompt_logprobs
        if logprobs is not None:
            out._last_logprobs_len = len(out.logprobs)
            out.logprobs += logprobs
        if reason is not None:
            self._done = True
            out.finish_reason = _FINISH_REASONS[reason]
        if reason == "stop_words":
            self._trim_stop_words(out)
        out.text = self._tokenizer.decode(out.token_ids)
        if out.finish_reason in (None, "stop", "length"):
            self._cut_at_stop(out)
        self._executor._handle_background_error()

    def _trim_stop_words(self, out: CompletionOutput) -> None:
        # As in GenerationResultBase._handle_sequence: the stop word's tokens are removed
        # from token_ids, unless include_stop_str_in_output.
        for reason, words in self._sampling._get_stop_reasons_and_words():
            if words and out.token_ids[-len(words) :] == words:
                out.stop_reason = reason
                if not self._sampling.include_stop_str_in_output:
                    out.token_ids = out.token_ids[: -len(words)]
                return

    def _cut_at_stop(self, out: CompletionOutput) -> None:
        # As in DetokenizedGenerationResultBase: a stop string found in the cumulative
        # text is cut off (so text can shrink), and the request aborted.
        for reason, _ in self._sampling._get_stop_reasons_and_words():
            if not isinstance(reason, str) or reason not in out.text:
                continue
            pos = out.text.find(reason)
            keep = pos + len(reason) if self._sampling.include_stop_str_in_output else pos
            out.text = out.text[:keep]
            out.finish_reason = "stop"
            out.stop_reason = reason
            self.abort()
            self._done = True
            return


def _prompt_inputs(inputs: Any) -> dict[str, Any]:
    """As inputs/data.py's ``prompt_inputs``: a string is a text prompt, a list a token
    prompt (its first item must be an int: an empty list is an IndexError there), a dict
    one of the two; anything else, a tuple of ids too, is a TypeError."""
    if isinstance(inputs, str):
        return {"prompt": inputs}
    if isinstance(inputs, list):
        assert isinstance(inputs[0], int)
        return {"prompt_token_ids": inputs}
    if isinstance(inputs, dict):
        assert inputs.get("prompt") is not None or inputs.get("prompt_token_ids") is not None
        return inputs
    raise TypeError(f"Invalid type of inputs for llm.generate: {type(inputs)}")


class LLM:
    """The stand-in LLM: a tokenizer, ``args``, an executor and a worker thread, no GPU."""

    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        tokenizer_mode: str = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        **kwargs: Any,
    ) -> None:
        for key in kwargs:
            if key not in _VALID_KWARGS:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        if kwargs.get("guided_decoding_backend") not in _GUIDED_BACKENDS:
            raise ValueError(
                "guided_decoding_backend: Input should be 'xgrammar' or 'llguidance', got "
                f"{kwargs['guided_decoding_backend']!r}"
            )
        kv = kwargs.get("kv_cache_config")
        if kv is not None and not isinstance(kv, KvCacheConfig):
            raise TypeError("kv_cache_config must be a KvCacheConfig")
        _standin.stats._add_llm(
            {"model": model, "tensor_parallel_size": tensor_parallel_size, **kwargs}
        )
        gate = _standin.controls.load_gate
        if gate is not None:
            gate.wait()  # loading takes long: callers must keep this off their event loop
        kv = kv or KvCacheConfig()
        # With the PyTorch backend, args.max_seq_len stays None unless passed: the worker
        # settles the real limit (executor/base_worker.py, py_executor_creator.py).
        self.args = SimpleNamespace(
            model=str(model),
            backend=kwargs.get("backend", "pytorch"),
            tensor_parallel_size=tensor_parallel_size,
            max_batch_size=kwargs.get("max_batch_size", 2048),
            max_num_tokens=kwargs.get("max_num_tokens", 8192),
            max_seq_len=kwargs.get("max_seq_len"),
            enable_chunked_prefill=kwargs.get("enable_chunked_prefill", False),
            kv_cache_config=kv,
            guided_decoding_backend=kwargs.get("guided_decoding_backend"),
        )
        self._hf_model_config = SimpleNamespace(
            max_position_embeddings=_standin.controls.max_position_embeddings,
            vocab_size=_standin.controls.vocab_size,
        )
        self._tokenizer = _standin.StandinTokenizer()
        worker = _standin.StepEngine(
            self._tokenizer,
            self.args.max_batch_size,
            self._worker_max_seq_len(kv),
            kv.enable_block_reuse,
            self.args.guided_decoding_backend,
        )
        process = _standin.start_worker_process() if _standin.controls.worker_process else None
        self._executor: _standin.Executor | None = _standin.Executor(worker, process)

    def _worker_max_seq_len(self, kv: KvCacheConfig) -> int:
        """What the worker settles on; the front end never learns it."""
        limit = self.args.max_seq_len or self._hf_model_config.max_position_embeddings
        caps = [c for c in (kv.max_tokens, _standin.controls.kv_cache_capacity) if c]
        if caps:
            kv_tokens = min(caps) // kv.tokens_per_block * kv.tokens_per_block
            limit = min(limit, kv_tokens)
        return int(limit)

    @property
    def tokenizer(self) -> _standin.StandinTokenizer:
        return self._tokenizer

    def generate(
        self,
        inputs: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **kwargs: Any,
    ) -> RequestOutput | list[RequestOutput]:
        """Blocking batch generation, built on generate_async as in the real LLM."""
        unbatched = not isinstance(inputs, list) or (bool(inputs) and isinstance(inputs[0], int))
        batch: list[Any] = [inputs] if unbatched else list(inputs)
        outputs = []
        for i, one in enumerate(batch):
            sp = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
            outputs.append(self.generate_async(one, sp, streaming=False, **kwargs))
        for output in outputs:
            output.result()
        return outputs[0] if unbatched else outputs

    def generate_async(
        self,
        inputs: str | list[int] | dict[str, Any],
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        executor = self._executor
        if executor is None or executor.is_shutdown():
            raise RuntimeError("LLM is shutting down")
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if sp.end_id is None:
            sp._setup(self._tokenizer)
        inputs = _prompt_inputs(inputs)
        if "prompt_token_ids" in inputs:
            prompt, ids = None, inputs["prompt_token_ids"]
        else:
            # The input processor tokenizes a text prompt here, on the caller's thread.
            with _standin.stats._cond:
                _standin.stats.prompts_encoded += 1
            prompt = inputs["prompt"]
            ids = self._tokenizer.encode(prompt, add_special_tokens=sp.add_special_tokens)
        max_num_tokens = self.args.max_num_tokens
        if not self.args.enable_chunked_prefill and max_num_tokens and len(ids) > max_num_tokens:
            raise ValueError(
                f"The sum of prompt length ({len(ids)}), query length (0) should not exceed "
                f"max_num_tokens ({max_num_tokens})"
            )
        record = _standin.RequestRecord(next(_ids), prompt, ids, sp, streaming)
        output = RequestOutput(executor, self._tokenizer, record, streaming)
        _standin.stats._add_request(record)
        executor.submit(record, output._deliver)
        return output

    def shutdown(self) -> None:
        # As in llmapi/llm.py: if the executor's shutdown raises, _executor stays set.
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
