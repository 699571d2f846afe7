"""STAND-IN for NVIDIA TensorRT-LLM, for the gateway's tests only (see ../README.md).

Mirrors the top-level names of the real package that the gateway uses.
"""

from tensorrt_llm.llmapi import LLM, KvCacheConfig, RequestOutput
from tensorrt_llm.sampling_params import SamplingParams

__version__ = "1.2.0+standin"

__all__ = ["LLM", "KvCacheConfig", "RequestOutput", "SamplingParams"]
