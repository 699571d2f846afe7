"""Completion clients a user already has, unmodified, against a running gateway's
``POST /v1/completions``: ``python completion_clients.py SCENARIO BASE_URL API_KEY MODEL``.

Scenarios: ``llamaindex`` (LlamaIndex's ``OpenAILike`` with its defaults, which are a
completion model's: ``.complete``, ``.stream_complete`` and ``.chat``, which it sends as one
prompt), ``litellm`` (``litellm.text_completion``, whole and streamed). The ``llm`` CLI is
run by the test itself, as a person runs it. Prints one JSON object on its last line;
exits non-zero on an error.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def llamaindex(base_url: str, key: str, model: str) -> dict[str, Any]:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=model, api_base=base_url, api_key=key, max_tokens=8, max_retries=0)
    whole = llm.complete("The capital of France is")
    streamed = list(llm.stream_complete("The capital of France is"))
    chat = llm.chat([ChatMessage(role="user", content="What is the capital of France?")])
    return {
        "is_chat_model": llm.metadata.is_chat_model,
        "complete": whole.text,
        "stream": streamed[-1].text if streamed else "",
        "chunks": len(streamed),
        "chat": chat.message.content,
        "chat_role": str(chat.message.role.value),
    }


def litellm(base_url: str, key: str, model: str) -> dict[str, Any]:
    import litellm as lite

    name = f"text-completion-openai/{model}"
    common = {"model": name, "api_base": base_url, "api_key": key, "max_tokens": 8}
    whole = lite.text_completion(prompt="The capital of France is", **common)
    pieces = lite.text_completion(prompt="The capital of France is", stream=True, **common)
    streamed = "".join(chunk.choices[0].text or "" for chunk in pieces)
    return {
        "text": whole.choices[0].text,
        "finish": whole.choices[0].finish_reason,
        "usage": dict(whole.usage) if whole.usage else None,
        "stream": streamed,
    }


SCENARIOS = {"llamaindex": llamaindex, "litellm": litellm}

if __name__ == "__main__":
    scenario, base_url, api_key, model_name = sys.argv[1:5]
    print(json.dumps(SCENARIOS[scenario](base_url, api_key, model_name), default=str))
