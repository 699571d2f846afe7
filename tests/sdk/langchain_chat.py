"""LangChain's ``ChatOpenAI`` (langchain-openai), unmodified, against a running gateway's
Chat Completions: ``python langchain_chat.py SCENARIO BASE_URL API_KEY MODEL``.

Scenarios: ``stream`` (``invoke``, then ``stream`` with usage), ``tools`` (``bind_tools``:
the model calls a tool, its output goes back as a ``ToolMessage``, the model answers).
Prints one JSON object on its last line; exits non-zero on an error.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def get_weather(text: str) -> str:
    """The weather a request in words asks for (the sim engine's calls carry ``text``)."""
    return "Sunny, 21 degrees"


def stream(llm: ChatOpenAI) -> dict[str, Any]:
    whole = llm.invoke("What is the capital of France?")
    chunks: list[AIMessageChunk] = list(llm.stream("Tell me a story."))
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined = joined + chunk
    return {
        "invoke": whole.content,
        "invoke_finish": whole.response_metadata.get("finish_reason"),
        "chunks": len(chunks),
        "text": joined.content,
        "finish": joined.response_metadata.get("finish_reason"),
        "usage": joined.usage_metadata,
    }


def tools(llm: ChatOpenAI) -> dict[str, Any]:
    with_tools = llm.bind_tools([get_weather])
    question = HumanMessage("Please call get_weather for Seoul.")
    called = with_tools.invoke([question])
    outputs = [
        ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
        for call in called.tool_calls
    ]
    answer = with_tools.invoke([question, called, *outputs])
    streamed = list(with_tools.stream([question]))
    joined = streamed[0]
    for chunk in streamed[1:]:
        joined = joined + chunk
    return {
        "calls": [{"name": c["name"], "id": c["id"]} for c in called.tool_calls],
        "answer": answer.content,
        "streamed_calls": [c["name"] for c in joined.tool_calls],
    }


def main() -> None:
    scenario, base_url, api_key, model = sys.argv[1:5]
    llm = ChatOpenAI(
        base_url=base_url, api_key=api_key, model=model, max_retries=0, stream_usage=True
    )
    result = {"stream": stream, "tools": tools}[scenario](llm)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
