"""Structured output from the clients people bring, unmodified, against a running gateway:
``python structured.py BASE_URL API_KEY MODEL``.

- The OpenAI Agents SDK: an ``Agent`` with ``output_type`` (a pydantic model) on both of
  its model classes, ``OpenAIResponsesModel`` (``text.format`` json_schema, strict) and
  ``OpenAIChatCompletionsModel`` (``response_format`` json_schema, strict).
- LangChain's ``ChatOpenAI.with_structured_output``: its default method (``json_schema``),
  ``json_mode`` (``response_format: json_object``, a JSON Schema dict parsed as JSON) and
  ``function_calling`` (the schema as a tool, ``tool_choice`` naming it).

Runs in ``.venv-sdk``. Prints one JSON object on its last line: what each client parsed
(as plain JSON, for the test to validate against the schema), and the schema.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Literal

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel, Field


class City(BaseModel):
    """A city and what it is known for."""

    name: str = Field(description="The city's name")
    country: str
    population: int
    kind: Literal["capital", "town"]
    landmarks: list[str]


PROMPT = "Describe Paris, the capital of France, with two landmarks."


async def agents(base_url: str, api_key: str, model: str) -> dict[str, Any]:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    out: dict[str, Any] = {}
    for label, model_class in (
        ("responses", OpenAIResponsesModel),
        ("chat", OpenAIChatCompletionsModel),
    ):
        agent = Agent(
            name="Describer",
            instructions="Describe the city the user names.",
            model=model_class(model=model, openai_client=client),
            output_type=City,
        )
        result = await Runner.run(agent, PROMPT, run_config=RunConfig(tracing_disabled=True))
        assert isinstance(result.final_output, City), result.final_output
        out[label] = result.final_output.model_dump()
    return out


def langchain(base_url: str, api_key: str, model: str) -> dict[str, Any]:
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0)
    default = llm.with_structured_output(City).invoke(PROMPT)
    assert isinstance(default, City), default
    as_json = llm.with_structured_output(City.model_json_schema(), method="json_mode")
    mode = as_json.invoke(f"{PROMPT} Answer in JSON.")
    assert isinstance(mode, dict), mode
    called = llm.with_structured_output(City, method="function_calling").invoke(PROMPT)
    assert isinstance(called, City), called
    return {
        "json_schema": default.model_dump(),
        "json_mode": mode,
        "function_calling": called.model_dump(),
    }


def main() -> None:
    base_url, api_key, model = sys.argv[1:4]
    result = {
        "schema": City.model_json_schema(),
        "agents": asyncio.run(agents(base_url, api_key, model)),
        "langchain": langchain(base_url, api_key, model),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
