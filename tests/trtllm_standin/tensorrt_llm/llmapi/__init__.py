"""STAND-IN for ``tensorrt_llm.llmapi`` (tests only; see ../../README.md).

Same names, signatures and observable behaviour as the real LLM API in the parts the
gateway uses; the "model" is a scripted reply from ``tensorrt_llm._standin.controls``.
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
from tensorrt_llm.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "KvCacheConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]

# Keyword arguments the stand-in accepts; the real LLM validates against its LlmArgs fields
# and raises ValueError("LLM got invalid argument: ...") for anything else.
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
}
_ids = itertools.count(1)


class RequestError(RuntimeError):
    """The engine failed a request (the real one lives in tensorrt_llm.executor)."""


@dataclass(kw_only=True)
class KvCacheConfig:
    """Subset of the real pydantic model; unknown fields fail (TypeError here)."""

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = 0.9
    host_cache_size: int | None = None
    enable_partial_reuse: bool = True


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # 'stop' | 'length' | 'timeout' | 'cancelled'
    stop_reason: int | str | None = None
    _last_text_len: int = field(default=0, repr=False)
    _last_token_ids_len: int = field(default=0, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]


class RequestOutput:
    """The handle generate_async returns; iterating it yields itself, updated in place."""

    def __init__(
        self,
        engine: _standin.StepEngine,
        tokenizer: _standin.StandinTokenizer,
        record: _standin.RequestRecord,
        streaming: bool,
    ) -> None:
        self._engine = engine
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
        self.deliver = _standin.make_deliver(self._loop, self._queue)

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Ask the engine to drop the request; returns at once (fire-and-forget)."""
        self._engine.abort(self.request_id)
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
        new_ids, reason, cached = item
        out = self.outputs[0]
        self.cached_tokens = cached
        out._last_token_ids_len = len(out.token_ids)
        out._last_text_len = len(out.text)
        out.token_ids.extend(new_ids)
        out.text = self._tokenizer.decode(out.token_ids)
        if reason is not None:
            self._done = True
            out.finish_reason = reason
        if self._done and reason == "cancelled":
            return
        self._cut_at_stop(out)

    def _cut_at_stop(self, out: CompletionOutput) -> None:
        # As in DetokenizedGenerationResultBase: the stop string is searched in the
        # cumulative text, cut off (so text can shrink), and the request aborted.
        for stop in self._sampling.stop_strings():
            pos = out.text.find(stop)
            if pos < 0:
                continue
            keep = pos + len(stop) if self._sampling.include_stop_str_in_output else pos
            out.text = out.text[:keep]
            out.finish_reason = "stop"
            out.stop_reason = stop
            if not self._done:
                self.abort()
            self._done = True
            return


class LLM:
    """The stand-in LLM: a tokenizer, ``args`` and a step thread instead of a GPU."""

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
        kv = kwargs.get("kv_cache_config")
        if kv is not None and not isinstance(kv, KvCacheConfig):
            raise TypeError("kv_cache_config must be a KvCacheConfig")
        _standin.stats._add_llm(
            {"model": model, "tensor_parallel_size": tensor_parallel_size, **kwargs}
        )
        gate = _standin.controls.load_gate
        if gate is not None:
            gate.wait()  # loading takes long: callers must keep this off their event loop
        self.args = SimpleNamespace(
            model=str(model),
            backend=kwargs.get("backend", "pytorch"),
            tensor_parallel_size=tensor_parallel_size,
            max_batch_size=kwargs.get("max_batch_size", 2048),
            max_num_tokens=kwargs.get("max_num_tokens", 8192),
            max_seq_len=kwargs.get("max_seq_len"),
            enable_chunked_prefill=kwargs.get("enable_chunked_prefill", False),
            kv_cache_config=kv or KvCacheConfig(),
        )
        self._hf_model_config = SimpleNamespace(
            max_position_embeddings=_standin.controls.max_position_embeddings
        )
        self._tokenizer = _standin.StandinTokenizer()
        self._engine: _standin.StepEngine | None = _standin.StepEngine(
            self._tokenizer, self.args.max_batch_size, self.args.kv_cache_config.enable_block_reuse
        )

    @property
    def tokenizer(self) -> _standin.StandinTokenizer:
        return self._tokenizer

    @property
    def _max_seq_len(self) -> int:
        return int(self.args.max_seq_len or self._hf_model_config.max_position_embeddings)

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
        inputs: str | list[int],
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
        if self._engine is None:
            raise RuntimeError("LLM is shutting down")
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if sp.end_id is None:
            sp.end_id = _standin.EOS_ID
        if isinstance(inputs, str):
            prompt: str | None = inputs
            ids = self._tokenizer.encode(inputs, add_special_tokens=sp.add_special_tokens)
        else:
            prompt, ids = None, list(inputs)
        max_num_tokens = self.args.max_num_tokens
        if not self.args.enable_chunked_prefill and max_num_tokens and len(ids) > max_num_tokens:
            raise ValueError(
                f"The sum of prompt length ({len(ids)}), query length (0) should not exceed "
                f"max_num_tokens ({max_num_tokens})"
            )
        record = _standin.RequestRecord(next(_ids), prompt, ids, sp, streaming)
        output = RequestOutput(self._engine, self._tokenizer, record, streaming)
        _standin.stats._add_request(record)
        if len(ids) + sp.max_tokens > self._max_seq_len:
            # The real executor reports an oversized request as an error response.
            raise RequestError(
                f"prompt ({len(ids)}) + max_tokens ({sp.max_tokens}) exceeds "
                f"max_seq_len ({self._max_seq_len})"
            )
        plan = self._tokenizer.encode(_standin.controls.reply, add_special_tokens=False)
        self._engine.submit(
            _standin._Active(
                record=record,
                plan=[*plan, _standin.EOS_ID],
                max_tokens=sp.max_tokens,
                ignore_eos=sp.ignore_eos,
                deliver=output.deliver,
                streaming=streaming,
                cached=self._engine.cached_prefix(ids),
            )
        )
        return output

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
            _standin.stats._add_shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
