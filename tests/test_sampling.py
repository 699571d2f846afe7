"""``frequency_penalty`` and ``presence_penalty``: read on both dialects, shown in the
session, and handed to the engine (what each engine does with them is tested with the
engine: tests/test_llamacpp.py, test_trtllm.py, test_upstream.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.engines.base import SamplingParams, TextDelta
from sessions import codec, errors
from sessions.realtime import codec as rt
from sessions.responses import codec as rp
from tests.support.harness import RawClient, running_gateway
from tests.support.responses_harness import ResponsesClient
from tests.support.scripted_engine import ScriptedEngine

PENALTIES = ("frequency_penalty", "presence_penalty")


def engine() -> ScriptedEngine:
    return ScriptedEngine([TextDelta("Fine.")])


def penalties(sampling: SamplingParams) -> tuple[float | None, float | None]:
    return sampling.frequency_penalty, sampling.presence_penalty


# -- decoding -------------------------------------------------------------------------


def test_session_update_and_response_create_read_both_penalties() -> None:
    update = rt.decode(
        json.dumps(
            {
                "type": "session.update",
                "session": {"frequency_penalty": 0.5, "presence_penalty": -2},
            }
        )
    )
    assert isinstance(update, rt.SessionUpdate)
    assert (update.patch.frequency_penalty, update.patch.presence_penalty) == (0.5, -2.0)
    create = rt.decode('{"type": "response.create", "response": {"presence_penalty": 2}}')
    assert isinstance(create, rt.ResponseCreate)
    assert create.params.presence_penalty == 2.0
    assert create.params.frequency_penalty == codec.UNSET
    body = rp.read_create({"input": "x", "frequency_penalty": -0.25, "presence_penalty": None})
    assert (body.frequency_penalty, body.presence_penalty) == (-0.25, None)


@pytest.mark.parametrize("name", PENALTIES)
@pytest.mark.parametrize(
    ("value", "code"), [(2.5, "invalid_value"), (-2.01, "invalid_value"), ("high", "invalid_type")]
)
def test_a_penalty_outside_chat_completions_range_is_refused(
    name: str, value: object, code: str
) -> None:
    for wrapper in ("session.update", "response.create"):
        key = "session" if wrapper == "session.update" else "response"
        with pytest.raises(errors.ProtocolError) as caught:
            rt.decode(json.dumps({"type": wrapper, key: {name: value}}))
        assert (caught.value.code, caught.value.param) == (code, f"{key}.{name}")
    with pytest.raises(errors.ProtocolError) as caught:
        rp.read_create({"input": "x", name: value})
    assert (caught.value.code, caught.value.param) == (code, name)


# -- through the gateway ----------------------------------------------------------------


async def test_realtime_session_shows_the_engine_defaults_and_passes_overrides() -> None:
    eng = engine()
    eng.default_sampling = SamplingParams(frequency_penalty=0.4, presence_penalty=0.1)
    async with running_gateway(eng) as gw, RawClient.connect(gw.ws_url) as c:
        session = c.events[0]["session"]
        assert (session["frequency_penalty"], session["presence_penalty"]) == (0.4, 0.1)
        await c.say("hi")
        await c.respond()
        assert penalties(eng.requests[-1].sampling) == (0.4, 0.1)
        await c.send({"type": "session.update", "session": {"frequency_penalty": 1.5}})
        updated = (await c.recv_until("session.updated"))["session"]
        assert (updated["frequency_penalty"], updated["presence_penalty"]) == (1.5, 0.1)
        await c.respond(presence_penalty=-1)  # this answer only
        assert penalties(eng.requests[-1].sampling) == (1.5, -1.0)
        await c.respond()
        assert penalties(eng.requests[-1].sampling) == (1.5, 0.1)
        await c.send({"type": "session.update", "session": {"presence_penalty": 3}})
        error = await c.recv_until("error")
        assert error["error"]["param"] == "session.presence_penalty"
        await c.respond()  # the session goes on with what it had
        assert penalties(eng.requests[-1].sampling) == (1.5, 0.1)


async def test_responses_websocket_and_http_pass_the_penalties() -> None:
    eng = engine()
    eng.default_sampling = SamplingParams(frequency_penalty=0.4)
    async with running_gateway(eng) as gw:
        url = gw.ws_url.replace("/v1/realtime", "/v1/responses")
        async with ResponsesClient.connect(url) as c:
            turn = await c.respond(input="hi", presence_penalty=0.75)
            assert turn.terminal["type"] == "response.completed"
            assert penalties(eng.requests[-1].sampling) == (0.4, 0.75)
            await c.create(input="hi", frequency_penalty=-3)
            assert (await c.error())["error"]["param"] == "frequency_penalty"
        async with httpx.AsyncClient(base_url=gw.http_url) as http:
            body = {"input": "hi", "frequency_penalty": -0.5, "presence_penalty": 1.25}
            done = await http.post("/v1/responses", json=body)
            assert done.status_code == 200 and done.json()["status"] == "completed"
            assert penalties(eng.requests[-1].sampling) == (-0.5, 1.25)
            plain = await http.post("/v1/responses", json={"input": "hi"})
            assert plain.status_code == 200
            assert penalties(eng.requests[-1].sampling) == (0.4, None)
            bad = await http.post("/v1/responses", json={"input": "x", "presence_penalty": 9})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "presence_penalty"
