"""The Realtime codec alone (sessions/realtime/codec.py): frames as strings, no socket;
every malformed input class gets a precise ProtocolError (the Responses codec's are in
tests/test_responses_codec.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessions import codec, errors
from sessions.realtime import codec as rt


def err(frame: str | bytes) -> errors.ProtocolError:
    with pytest.raises(errors.ProtocolError) as info:
        rt.decode(frame)
    return info.value


def test_session_update_as_the_sdk_sends_it() -> None:
    event = rt.decode(
        json.dumps(
            {
                "type": "session.update",
                "event_id": "e1",
                "session": {
                    "type": "realtime",
                    "model": "gpt-realtime",
                    "output_modalities": ["text"],
                    "instructions": "Be brief.",
                    "max_output_tokens": "inf",
                    "temperature": 0.2,
                    "stop": "\n\n",
                },
            }
        )
    )
    assert isinstance(event, rt.SessionUpdate)
    assert event.patch.instructions == "Be brief."
    assert event.patch.max_output_tokens is None
    assert event.patch.stop == ("\n\n",)
    assert event.patch.top_p == codec.UNSET


def test_item_create_joins_text_parts() -> None:
    event = rt.decode(
        '{"type":"conversation.item.create","item":{"type":"message","role":"user",'
        '"content":[{"type":"input_text","text":"안녕 "},{"type":"input_text","text":"🙂"}]}}'
    )
    assert isinstance(event, rt.ItemCreate)
    assert event.item.text == "안녕 🙂"
    assert event.item.role == "user"


def test_out_of_band_response_with_its_own_input() -> None:
    event = rt.decode(
        json.dumps(
            {
                "type": "response.create",
                "response": {
                    "conversation": "none",
                    "metadata": {"batch": "7"},
                    "input": [
                        {
                            "type": "message",
                            "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}],
                        }
                    ],
                },
            }
        )
    )
    assert isinstance(event, rt.ResponseCreate)
    assert event.params.out_of_band
    assert event.params.metadata == {"batch": "7"}
    assert event.params.input is not None and event.params.input[0].text == "hi"


@pytest.mark.parametrize(
    ("frame", "code", "param"),
    [
        (b"\x00\x01", "binary_frame_not_supported", None),
        ("{nope", "invalid_json", None),
        ("[1, 2]", "invalid_event", None),
        ('"text"', "invalid_event", None),
        ("{}", "missing_required_parameter", "type"),
        ('{"type": 5}', "invalid_type", "type"),
        ('{"type": "no.such.event"}', "unknown_event_type", "type"),
        ('{"type": "input_audio_buffer.append"}', "unsupported_modality", "type"),
        (
            '{"type": "conversation.item.create", "item": {"type": "message", "role": "user",'
            ' "content": [{"type": "input_audio", "audio": "AAAA"}]}}',
            "unsupported_modality",
            "item.content[0].type",
        ),
        (
            '{"type": "session.update", "session": {"output_modalities": ["audio"]}}',
            "unsupported_modality",
            "session.output_modalities",
        ),
        (
            '{"type": "session.update", "session": {"colour": 1}}',
            "unknown_parameter",
            "session.colour",
        ),
        (
            '{"type": "session.update", "session": {"temperature": "hot"}}',
            "invalid_type",
            "session.temperature",
        ),
        (
            '{"type": "session.update", "session": {"temperature": 9}}',
            "invalid_value",
            "session.temperature",
        ),
        (
            '{"type": "session.update", "session": {"seed": -1}}',
            "invalid_value",
            "session.seed",
        ),
        (  # past 2**64 - 1 the JSON parser yields a float: not an integer
            '{"type": "response.create", "response": {"seed": 18446744073709551616}}',
            "invalid_type",
            "response.seed",
        ),
        (
            '{"type": "session.update", "session": {"max_output_tokens": 0}}',
            "invalid_value",
            "session.max_output_tokens",
        ),
        (
            '{"type": "session.update", "session": {"stop": ["a","b","c","d","e"]}}',
            "invalid_value",
            "session.stop",
        ),
        ('{"type": "session.update", "session": []}', "invalid_type", "session"),
        ('{"type": "conversation.item.create"}', "missing_required_parameter", "item"),
        (
            '{"type": "conversation.item.create",'
            ' "item": {"type": "message", "role": "robot", "content": []}}',
            "invalid_value",
            "item.role",
        ),
        (
            '{"type": "conversation.item.create",'
            ' "item": {"type": "message", "role": "user", "content": []}}',
            "invalid_type",
            "item.content",
        ),
        (
            '{"type": "conversation.item.create", "item": {"type": "message", "role": "user",'
            ' "content": [{"type": "input_text", "text": 3}]}}',
            "invalid_type",
            "item.content[0].text",
        ),
        ('{"type": "conversation.item.delete"}', "missing_required_parameter", "item_id"),
        (
            '{"type": "response.create", "response": {"conversation": "x"}}',
            "invalid_value",
            "response.conversation",
        ),
        (
            '{"type": "response.create", "response": {"metadata": {"a": 1}}}',
            "invalid_value",
            "response.metadata",
        ),
        ('{"type": "response.create", "extra": 1}', "unknown_parameter", "extra"),
        ('{"type": "response.cancel", "response_id": 7}', "invalid_type", "response_id"),
    ],
)
def test_malformed_events(frame: str | bytes, code: str, param: str | None) -> None:
    error = err(frame)
    assert (error.code, error.param) == (code, param)
    assert error.message


def test_seed_is_any_unsigned_64_bit_integer() -> None:
    # Every engine gets the same range: TensorRT-LLM's sampler takes a uint64 seed.
    for seed in (0, 2**64 - 1):
        event = rt.decode(json.dumps({"type": "session.update", "session": {"seed": seed}}))
        assert isinstance(event, rt.SessionUpdate) and event.patch.seed == seed


def test_error_event_carries_the_clients_event_id() -> None:
    error = err('{"type": "nope", "event_id": "client-42"}')
    event = codec.error_event(error)
    assert event["type"] == "error"
    assert event["error"]["event_id"] == "client-42"
    assert event["error"]["type"] == "invalid_request_error"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_types = st.sampled_from(
    [
        "session.update",
        "conversation.item.create",
        "conversation.item.delete",
        "conversation.item.retrieve",
        "response.create",
        "response.cancel",
    ]
)


@settings(max_examples=400, deadline=None)
@given(event_type=_types, body=st.dictionaries(st.text(max_size=12), _json, max_size=5))
def test_random_events_decode_or_raise_protocol_error(
    event_type: str, body: dict[str, object]
) -> None:
    frame = json.dumps({**body, "type": event_type})
    try:
        rt.decode(frame)
    except errors.ProtocolError as error:
        assert error.code and error.message


def test_the_session_object_the_server_sends_can_be_sent_back() -> None:
    echoed = {
        "type": "realtime",
        "object": "realtime.session",
        "id": "sess_1",
        "model": "m",
        "output_modalities": ["text"],
        "instructions": "unset",  # an ordinary string, not the "field absent" marker
        "tools": [],
        "tool_choice": "auto",
        "tracing": None,
    }
    event = rt.decode(json.dumps({"type": "session.update", "session": echoed}))
    assert isinstance(event, rt.SessionUpdate)
    assert event.patch.instructions == "unset"
    mcp = {"type": "mcp", "server_label": "x"}
    error = err(json.dumps({"type": "session.update", "session": {"tools": [mcp]}}))
    assert (error.code, error.param) == ("unsupported_tool_type", "session.tools[0].type")


@pytest.mark.parametrize("role", [[], {}, ["user"]])
def test_an_unhashable_role_is_a_protocol_error(role: Any) -> None:
    """Found by bench/adversarial.py: it raised TypeError, which closed the connection."""
    item = {"type": "message", "role": role, "content": [{"type": "input_text", "text": "x"}]}
    with pytest.raises(errors.ProtocolError) as refused:
        rt.decode(json.dumps({"type": "conversation.item.create", "item": item}))
    assert refused.value.param == "item.role"
