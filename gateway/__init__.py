"""A streaming LLM gateway: OpenAI's Realtime (text), Responses, Chat Completions and
Completions APIs on one port, over one shared engine (llama.cpp, TensorRT-LLM, an upstream
pool of OpenAI-compatible servers, or a simulated one)."""

__version__ = "0.1.0"
