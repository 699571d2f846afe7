"""Structured output from the clients people bring, unmodified, against running gateways:
``python structured.py API_KEY MODEL BASE_URL...`` (each gateway in turn: one start-up of
the SDKs for several engines).

- The OpenAI Agents SDK: an ``Agent`` with ``output_type`` (a pydantic model) on both of
  its model classes, ``OpenAIResponsesModel`` (``text.format`` json_schema, strict) and
  ``OpenAIChatCompletionsModel`` (``response_format`` json_schema, strict).
- LangChain's ``ChatOpenAI.with_structured_output``: its default method (``json_schema``),
  ``json_mode`` (``response_format: json_object``, a JSON Schema dict parsed as JSON) and
  ``function_calling`` (the schema as a tool, ``tool_choice`` naming it).

Runs in ``.venv-sdk``. Prints one JSON object on its last line: the schema, and for each
gateway what each client parsed (as plain JSON, for the test to validate against the schema).
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
    """A city and what it is known for (bounded: a small model's answer stays short)."""

    name: str = Field(description="The city's name", max_length=20)
    kind: Literal["capital", "town"]
    landmarks: list[str] = Field(max_length=1)


PROMPT = "Describe Paris, the capital of France, with one landmark."


async def agents(base_url: str, api_key: str, model: str) -> dict[str, Any]:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)

    async def run(model_class: Any) -> dict[str, Any]:
        agent = Agent(
            name="Describer",
            instructions="Describe the city the user names.",
            model=model_class(model=model, openai_client=client),
            output_type=City,
        )
        result = await Runner.run(agent, PROMPT, run_config=RunConfig(tracing_disabled=True))
        assert isinstance(result.final_output, City), result.final_output
        return result.final_output.model_dump()

    responses, chat = await asyncio.gather(
        run(OpenAIResponsesModel), run(OpenAIChatCompletionsModel)
    )
    return {"responses": responses, "chat": chat}


async def langchain(base_url: str, api_key: str, model: str) -> dict[str, Any]:
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0)
    as_json = llm.with_structured_output(City.model_json_schema(), method="json_mode")
    default, mode, called = await asyncio.gather(
        llm.with_structured_output(City).ainvoke(PROMPT),
        as_json.ainvoke(f"{PROMPT} Answer in JSON."),
        llm.with_structured_output(City, method="function_calling").ainvoke(PROMPT),
    )
    assert isinstance(default, City), default
    assert isinstance(mode, dict), mode
    assert isinstance(called, City), called
    return {
        "json_schema": default.model_dump(),
        "json_mode": mode,
        "function_calling": called.model_dump(),
    }


async def gateway(base_url: str, api_key: str, model: str) -> dict[str, Any]:
    found, chained = await asyncio.gather(
        agents(base_url, api_key, model), langchain(base_url, api_key, model)
    )
    return {"agents": found, "langchain": chained}


def main() -> None:
    api_key, model, *base_urls = sys.argv[1:]
    result: dict[str, Any] = {"schema": City.model_json_schema(), "gateways": []}
    for base_url in base_urls:
        result["gateways"].append(asyncio.run(gateway(base_url, api_key, model)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
