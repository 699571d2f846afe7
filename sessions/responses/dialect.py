"""The Responses dialect: the OpenAI Responses API's events over the session core.

Each ``response.create`` is one turn that sends only its new input; the conversation
it continues is named by ``previous_response_id``: the latest response of a lane of
this connection (kept in memory), or one in the gateway's response store (any
connection's, ``store: true``). Lanes (``stream_id``) run their turns in order,
different lanes at once, at most ``MAX_IN_FLIGHT`` per connection (more wait, in
order); every event of a named lane carries its ``stream_id``. Events are numbered
from 0 per session, so a resumed connection gets exactly what it missed.

Who owns what: the lanes, the turns waiting in them and the steering input belong
to this object, which runs on the session actor's turn like the core; the response
store is the gateway's, shared, and touched only on the event loop thread. What a turn
looks like (its ``Response`` object, its items' events, the steering events, its
snapshot) is sessions/responses/turns.py's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import orjson

from gateway.engines.base import (
    GenerationRequest,
    Message,
    PromptLogprobs,
    SamplingParams,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.scheduler import Job, Outcome
from sessions import codec, errors, formats
from sessions.conversation import Item, items_to_messages
from sessions.core import CallState, ResponseSpec, ResponseState, Session, item_status
from sessions.realtime.dialect import check_tool_choice, input_items
from sessions.response_store import ResponseStore, StoredResponse
from sessions.responses import codec as rp
from sessions.responses import turns
from sessions.responses.turns import Lane, Turn

MAX_IN_FLIGHT = 16
MAX_LANES = 32
MAX_WAITING = 1024  # turns waiting for a lane or a slot, per connection (memory bound)
MAX_PENDING_STEERS = 8

# A response's text delta, as a template: the number and the text per delta; its item id
# (and lane) spliced in once per response (ResponsesFraming.delta_ids). With log
# probabilities, they take the place of the empty list (a JSON key's quotes cannot occur
# unescaped inside the ids' strings, so the first match is the field).
_DELTA = (
    b'{"type":"response.output_text.delta","sequence_number":%%d%b'
    b',"output_index":0,"content_index":0,"logprobs":[],"delta":%%b}'
)
_NO_LOGPROBS, _LOGPROBS = b'"logprobs":[]', b'"logprobs":%b'


log = logging.getLogger(__name__)


class ResponsesFraming:
    """Responses events carry ``sequence_number`` (from 0, per session); no event ids."""

    __slots__ = ()
    first_sequence_number = 0
    replays_first = True

    def numbered(self, seq: int, body: bytes) -> bytes:
        return b'{"sequence_number":%d,%b' % (seq, body[1:])

    def delta_ids(self, response_id: str, item_id: str) -> bytes:
        # The delta key is "response id" or "response id stream id" (see Lane.key).
        _, _, stream_id = response_id.partition(" ")
        ids = b',"item_id":%b' % orjson.dumps(item_id)
        if stream_id:
            ids += b',"stream_id":%b' % orjson.dumps(stream_id)
        return _DELTA % ids.replace(b"%", b"%%")

    def delta(self, seq: int, ids: bytes, text: str) -> bytes:
        return ids % (seq, orjson.dumps(text))

    def delta_logprobs(
        self, seq: int, ids: bytes, text: str, logprobs: Sequence[TokenLogprob]
    ) -> bytes:
        lps = orjson.dumps(codec.text_logprobs_json(logprobs))
        return ids.replace(_NO_LOGPROBS, _LOGPROBS, 1) % (seq, lps, orjson.dumps(text))


class _Prefill:
    """The sink of a ``generate: false`` turn's prefill job: its output is not wanted."""

    __slots__ = ("_done",)

    def __init__(self, done: Callable[[Outcome], None]) -> None:
        self._done = done

    def on_delta(self, job: Job, text: str, token_ids: tuple[int, ...] = ()) -> None:
        pass

    def on_logprobs_delta(
        self,
        job: Job,
        text: str,
        logprobs: tuple[TokenLogprob, ...],
        token_ids: tuple[int, ...] = (),
    ) -> None:
        pass

    def on_prompt_logprobs(self, job: Job, logprobs: PromptLogprobs) -> None:
        pass

    def on_tool_call_delta(self, job: Job, delta: ToolCallDelta) -> None:
        pass

    def on_finish(self, job: Job, outcome: Outcome) -> None:
        self._done(outcome)


class ResponseObserver(Protocol):
    """Who waits on an HTTP request's response (gateway/api/responses_http.py): told when it
    starts and ends, with the ``Response`` object, or why it was refused."""

    def started(self, body: codec.JSON) -> None: ...

    def ended(self, body: codec.JSON) -> None: ...

    def refused(self, err: errors.ProtocolError) -> None: ...


class ResponsesDialect:
    """A session's Responses half (see the module docstring).

    With an ``observer`` (HTTP: one response per session) a refused request is told to
    it, to be answered with an HTTP status, instead of becoming an ``error`` event."""

    name = "responses"
    decode = staticmethod(rp.decode)

    def __init__(
        self, store: ResponseStore | None = None, observer: ResponseObserver | None = None
    ) -> None:
        self._core: Session | None = None
        self.store = store
        self.observer = observer
        self._lanes: dict[str | None, Lane] = {}
        self._ready: deque[Lane] = deque()  # lanes with a turn waiting for a slot
        self._waiting = 0
        self._hosted_logged = False  # one log line per connection for ignored hosted tools

    @property
    def core(self) -> Session:
        assert self._core is not None
        return self._core

    def attach(self, core: Session, greet: bool) -> None:
        self._core = core

    # -- a session store's snapshot (sessions/snapshot.py) ------------------------------

    def dump(self) -> dict[str, Any]:
        """Each lane's latest response (its id: the store has it, when it was stored) and
        the turns waiting in it for a slot (a takeover starts them in their turn)."""
        return {
            "lanes": [
                [lane.stream_id, lane.latest.id if lane.latest is not None else None]
                for lane in self._lanes.values()
            ],
            "waiting": [
                [lane.stream_id, [turns.body_json(body) for body in lane.waiting]]
                for lane in self._ready
                if lane.waiting
            ],
        }

    def load(self, state: dict[str, Any]) -> None:
        for stream_id, latest in state["lanes"]:
            lane = self._lane(stream_id)
            stored = (
                self.store.get(latest, self.core.tenant)
                if self.store is not None and latest
                else None
            )
            if stored is not None:
                lane.latest = stored
        for stream_id, bodies in state.get("waiting", []):
            lane = self._lane(stream_id)
            lane.waiting.extend(turns.body_from(b) for b in bodies)
            self._waiting += len(bodies)
            self._ready.append(lane)
        if self._waiting:
            # On the actor's first turn: after the answers in flight went on (and took
            # their lanes and slots), as they would have here.
            self.core.call_soon(self._start_ready)

    def dump_tag(self, tag: object) -> Any:
        assert isinstance(tag, Turn)
        return turns.turn_json(tag)

    def load_tag(self, data: Any) -> object:
        return turns.turn_from(data, self._lane(data["lane"]))

    def response_continued(self, r: ResponseState) -> None:
        self._turn(r).lane.running = r

    def _lane(self, stream_id: str | None) -> Lane:
        lane = self._lanes.get(stream_id)
        if lane is None:
            key = self.core.conversation_id + (f" {stream_id}" if stream_id else "")
            lane = self._lanes[stream_id] = Lane(stream_id, key)
        return lane

    @property
    def latest(self) -> StoredResponse | None:
        """The latest finished response of the lane without a stream_id (HTTP's one)."""
        lane = self._lanes.get(None)
        return lane.latest if lane is not None else None

    def resumed(self, resume_token: str) -> bytes | None:
        return None  # the upgrade's headers say it (gateway/server.py)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.waiting.clear()
            if lane.warming is not None:
                self.core.scheduler.cancel(lane.warming, "disconnected")
        self._ready.clear()
        self._waiting = 0

    def expire(self) -> None:
        """The connection reached ``--responses-max-age``: say so, then end it."""
        self.error(
            errors.ProtocolError(
                "websocket_connection_limit_reached",
                "This connection reached its maximum age; open a new one (responses stored "
                "with store: true can be continued there).",
            )
        )
        self.core.close("disconnected", 1000, "connection age limit reached")

    # -- commands --------------------------------------------------------------------

    def handle(self, command: object) -> None:
        match command:
            case rp.Create():
                self._create(command.body)
            case rp.Cancel():
                self._cancel(command.response_id)
            case rp.Steer():
                self._steer(command)
            case rp.Ignored():
                pass

    def error(self, err: errors.ProtocolError, stream_id: str | None = None) -> None:
        if self.observer is not None:
            self.observer.refused(err)
            return
        event = rp.error_json(err, codec.http_status(err))
        if stream_id is not None:
            event["stream_id"] = stream_id
        self.core.outbox.put(event)

    def _create(self, body: rp.CreateBody) -> None:
        limits = self.core.limits
        codec.check_model(body.model, limits.served_models)
        if body.hosted_tools:
            self._hosted(body.hosted_tools, limits.hosted_tools)
        lane = self._lanes.get(body.stream_id)
        if lane is None:
            if body.stream_id is not None and sum(k is not None for k in self._lanes) >= MAX_LANES:
                raise errors.ProtocolError(
                    "websocket_stream_limit_reached",
                    f"A connection has at most {MAX_LANES} named lanes (stream_id).",
                    param="stream_id",
                )
            lane = self._lane(body.stream_id)
        if self._waiting >= MAX_WAITING:
            raise errors.ProtocolError(
                "too_many_queued_responses",
                f"At most {MAX_WAITING} response.create may wait on one connection.",
                param="stream_id" if body.stream_id else None,
            )
        lane.waiting.append(body)
        self._waiting += 1
        self._ready.append(lane)
        self._start_ready()

    def _hosted(self, hosted: tuple[tuple[str, str], ...], policy: str) -> None:
        """Tools that run on OpenAI's servers: refused, or left out of the prompt."""
        if policy == "refuse":
            param, kind = hosted[0]
            raise errors.ProtocolError(
                "unsupported_value",
                f"Tool type '{kind}' runs on OpenAI's servers, which this gateway is not: "
                "send function tools (or start the gateway with --hosted-tools ignore).",
                param=param,
            )
        if not self._hosted_logged:
            self._hosted_logged = True
            kinds = ", ".join(sorted({kind for _, kind in hosted}))
            log.info("session %s: hosted tools left out of the prompt: %s", self.core.id, kinds)

    def _in_flight(self) -> int:
        return self.core.live_responses + sum(
            lane.warming is not None for lane in self._lanes.values()
        )

    def _start_ready(self) -> None:
        """Start waiting turns, oldest lane first, while a slot is free."""
        skipped: deque[Lane] = deque()
        while self._ready and self._in_flight() < MAX_IN_FLIGHT and not self.core.closing:
            lane = self._ready.popleft()
            if lane.busy or not lane.waiting:
                if lane.waiting:
                    skipped.append(lane)  # it runs when its own turn ends
                continue
            body = lane.waiting.popleft()
            self._waiting -= 1
            try:
                self._start(lane, body)
            except errors.ProtocolError as err:
                self._lane_error(err, lane)
                if lane.waiting:
                    self._ready.append(lane)
        self._ready.extendleft(reversed(skipped))

    def _lane_error(self, err: errors.ProtocolError, lane: Lane) -> None:
        self.core.note_refusal(err)
        self.error(err, lane.stream_id)

    def _history(self, lane: Lane, body: rp.CreateBody) -> StoredResponse | None:
        """The response ``body`` continues: a lane's latest here, else the store's."""
        wanted = body.previous_response_id
        if wanted is None:
            return None
        if lane.latest is not None and lane.latest.id == wanted:
            return lane.latest
        for other in self._lanes.values():  # a fork: another lane's latest, on a new lane
            if other.latest is not None and other.latest.id == wanted:
                return other.latest
        stored = self.store.get(wanted, self.core.tenant) if self.store is not None else None
        if stored is None:
            raise errors.ProtocolError(
                "previous_response_not_found",
                f"Previous response with id '{wanted}' not found.",
                param="previous_response_id",
            )
        return stored

    def _start(
        self, lane: Lane, body: rp.CreateBody, steers: list[tuple[str, rp.Steer]] | None = None
    ) -> None:
        core, c = self.core, self.core.config
        previous = self._history(lane, body)
        history = previous.history if previous is not None else ()
        queued = steers or []
        if previous is not None and lane.latest is previous and lane.pending_steers:
            queued, lane.pending_steers = [*lane.pending_steers, *queued], []
        steer_specs = tuple(spec for _, steer in queued for spec in steer.input)
        items = tuple(input_items((*steer_specs, *body.input), "input", None, history))
        for item in items:  # made just now, by input_items: theirs to name
            if not item.id:
                item.id = core.free_item_id()
        tools = codec.chosen(body.tools, c.tools)
        choice = codec.chosen(body.tool_choice, c.tool_choice)
        check_tool_choice(tools, choice, "", None)
        instructions = body.instructions if body.instructions is not None else c.instructions
        system = [Message("system", instructions)] if instructions else []
        messages = (*system, *items_to_messages([*history, *items]))
        sampling = SamplingParams(
            max_output_tokens=codec.chosen(body.max_output_tokens, c.max_output_tokens),
            temperature=codec.chosen(body.temperature, c.temperature),
            top_p=codec.chosen(body.top_p, c.top_p),
            seed=c.seed,
            stop=c.stop,
            frequency_penalty=codec.chosen(body.frequency_penalty, c.frequency_penalty),
            presence_penalty=codec.chosen(body.presence_penalty, c.presence_penalty),
            logprobs=body.logprobs,
        )
        turn = Turn(body, lane, history, items, int(time.time()), body.instructions, tools, choice)
        if not body.generate:
            self._prefill(lane, turn, messages, sampling)
            return
        spec = ResponseSpec(
            messages=messages,
            sampling=sampling,
            tools=tools,
            tool_choice=choice,
            in_conversation=False,
            affinity_key=core.affinity(body.affinity_key) or lane.affinity_key,
            metadata=body.metadata,
            tag=turn,
            constraint=formats.constraint(body.text_format) if body.text_format else None,
            parallel_tool_calls=body.parallel_tool_calls,
            logprobs_param="include",
            model=body.model or "",
        )
        response = core.start_response(spec)
        if response is None:
            raise errors.ProtocolError(
                "overloaded",
                "The gateway is at capacity (every engine slot and queue place is taken); "
                "retry shortly.",
                error_type="server_error",
            )
        lane.running = response

    # -- generate: false -------------------------------------------------------------

    def _prefill(
        self, lane: Lane, turn: Turn, messages: tuple[Message, ...], sampling: SamplingParams
    ) -> None:
        """Store the input as a response without output; prefill the lane's cache."""
        core = self.core
        core.check_rate_limits(1)  # a prefill takes an engine slot as an answer does
        response_id = codec.new_id("resp")
        request = GenerationRequest(
            request_id=response_id,
            messages=messages,
            # A token to warm the cache with, whose log probabilities nobody reads.
            sampling=replace(sampling, max_output_tokens=1, logprobs=None),
            affinity_key=core.affinity(turn.body.affinity_key) or lane.affinity_key,
        )
        job = Job(
            request,
            session_key=core.id,
            sink=_Prefill(
                lambda o: core.call_soon(lambda: self._prefilled(lane, turn, response_id, o))
            ),
            tenant=core.tenant,
        )
        body = self._response_json(response_id, turn, "in_progress")
        self._put(lane, {"type": "response.created", "response": body})
        if self.observer is not None:
            self.observer.started(body)
        if core.scheduler.submit(job):
            lane.warming = job
        else:  # no slot to warm a cache with: the turn is stored all the same
            self._prefilled(lane, turn, response_id, None)

    def _prefilled(self, lane: Lane, turn: Turn, response_id: str, outcome: Outcome | None) -> None:
        lane.warming = None
        usage = (
            None
            if outcome is None
            else rp.usage_json(outcome.usage.input_tokens, 0, outcome.usage.cached_tokens)
        )
        body = self._response_json(response_id, turn, "completed", [], usage)
        self._put(lane, {"type": "response.completed", "response": body})
        if self.observer is not None:
            self.observer.ended(body)
        self._remember(lane, turn, response_id, body, (), ())
        self._after_turn(lane)

    # -- the core's reports ----------------------------------------------------------

    def _turn(self, r: ResponseState) -> Turn:
        assert isinstance(r.spec.tag, Turn)
        return r.spec.tag

    def _put(self, lane: Lane, event: codec.JSON) -> None:
        if lane.stream_id is not None:
            event["stream_id"] = lane.stream_id
        self.core.outbox.put(event)

    def _response_json(
        self,
        response_id: str,
        turn: Turn,
        status: str,
        output: list[codec.JSON] | None = None,
        usage: codec.JSON | None = None,
        incomplete: str | None = None,
        error: codec.JSON | None = None,
    ) -> codec.JSON:
        config = self.core.config
        return turns.response_json(
            response_id, turn, config, status, output, usage, incomplete, error
        )

    def response_started(self, r: ResponseState) -> None:
        turn = self._turn(r)
        if turn.lane.stream_id is not None:
            r.delta_key = f"{r.id} {turn.lane.stream_id}"
        body = self._response_json(r.id, turn, "in_progress")
        self._put(turn.lane, {"type": "response.created", "response": body})
        if self.observer is not None:
            self.observer.started(body)
        self._put(turn.lane, {"type": "response.in_progress", "response": body})

    def text_opened(self, r: ResponseState) -> None:
        lane = self._turn(r).lane
        for event in turns.text_opened(r):
            self._put(lane, event)

    def text_delta(
        self, r: ResponseState, text: str, logprobs: tuple[TokenLogprob, ...] | None
    ) -> None:
        self._put(self._turn(r).lane, turns.text_delta(r, text, logprobs))

    def prompt_logprobs(self, r: ResponseState, logprobs: PromptLogprobs) -> None:
        """Never asked for on this API."""

    def call_opened(self, r: ResponseState, call: CallState) -> None:
        turn = self._turn(r)
        self._put(turn.lane, turns.call_opened(turn, call))

    def call_delta(self, r: ResponseState, call: CallState, arguments: str) -> None:
        turn = self._turn(r)
        event = turns.call_delta(turn, call, arguments)
        if event is not None:
            self._put(turn.lane, event)

    def response_ended(self, r: ResponseState, outcome: Outcome) -> None:
        turn = self._turn(r)
        lane = turn.lane
        lane.running = None
        status = item_status(outcome)
        outputs: list[tuple[int, codec.JSON, Item]] = []
        if r.text_index is not None:
            outputs.append(
                (
                    r.text_index,
                    self._close_text(lane, r, outcome, status),
                    Item(r.item_id, "assistant", outcome.text, status),
                )
            )
        for call in r.calls.values():
            outputs.append(
                (
                    call.output_index,
                    self._close_call(turn, call, status),
                    Item.function_call(
                        call.item_id, call.call_id, call.name, call.arguments, status
                    ),
                )
            )
        outputs.sort(key=lambda entry: entry[0])
        usage = outcome.usage
        usage_json = rp.usage_json(usage.input_tokens, usage.output_tokens, usage.cached_tokens)
        kind, response_status, incomplete, error = turns.ending(turn, outcome)
        body = self._response_json(
            r.id, turn, response_status, [o for _, o, _ in outputs], usage_json, incomplete, error
        )
        self._put(lane, {"type": kind, "response": body})
        if self.observer is not None:
            self.observer.ended(body)
        calls = tuple(
            (call.call_id, call.name) for call in r.calls.values() if status == "completed"
        )
        self._remember(lane, turn, r.id, body, tuple(item for _, _, item in outputs), calls)
        self._settle_steers(lane, turn, r.id, response_status, calls)
        self._after_turn(lane)

    def _close_text(
        self, lane: Lane, r: ResponseState, outcome: Outcome, status: str
    ) -> codec.JSON:
        events, item = turns.text_closed(r, outcome.text, status, outcome.logprobs)
        for event in events:
            self._put(lane, event)
        return item

    def _close_call(self, turn: Turn, call: CallState, status: str) -> codec.JSON:
        events, item = turns.call_closed(turn, call, status)
        for event in events:
            self._put(turn.lane, event)
        return item

    def _remember(
        self,
        lane: Lane,
        turn: Turn,
        response_id: str,
        body: codec.JSON,
        outputs: tuple[Item, ...],
        calls: tuple[tuple[str, str], ...],
    ) -> None:
        history = (*turn.history, *turn.input, *outputs)
        stored = StoredResponse(response_id, body, history, turn.input, calls, self.core.tenant)
        lane.latest = stored
        if turn.body.store and self.store is not None:
            self.store.put(stored)

    def _after_turn(self, lane: Lane) -> None:
        if lane.waiting:
            self._ready.appendleft(lane)
        self._start_ready()

    # -- cancel and steer ------------------------------------------------------------

    def _cancel(self, response_id: str | None) -> None:
        live = [r for r in self.core.responses if not r.cancelling]
        target = (
            next((r for r in live if r.id == response_id), None)
            if response_id
            else (live[-1] if live else None)
        )
        if target is None:
            raise errors.ProtocolError(
                "response_not_found" if response_id else "response_cancel_not_active",
                f"No response '{response_id}' is in progress on this connection."
                if response_id
                else "No response is in progress on this connection.",
                param="response_id" if response_id else None,
            )
        self.core.cancel_response(target)

    def _steer(self, steer: rp.Steer) -> None:
        target = next((r for r in self.core.responses if r.id == steer.previous_response_id), None)
        if target is not None and not target.cancelling:
            turn = self._turn(target)
            if len(turn.steers) >= MAX_PENDING_STEERS:
                self._steer_failed(
                    steer,
                    None,
                    "too_many_pending_steers",
                    "Too much steering input is pending for this response.",
                    turn.lane,
                )
                return
            steer_id = codec.new_id(_STEERED)
            turn.steers.append((steer_id, steer))
            self._put(turn.lane, turns.steer_accepted(steer_id, target.id))
            # Stopped at the next token boundary; response_ended starts the successor.
            self.core.cancel_response(target)
            return
        lane = next(
            (
                ln
                for ln in self._lanes.values()
                if ln.latest is not None and ln.latest.id == steer.previous_response_id
            ),
            None,
        )
        if (
            lane is not None
            and lane.latest is not None
            and lane.latest.pending_calls
            and not lane.busy
        ):
            steer_id = codec.new_id(_STEERED)
            self._put(lane, turns.steer_accepted(steer_id, lane.latest.id))
            lane.pending_steers.append((steer_id, steer))
            self._put(lane, turns.steer_pending(steer_id, lane.latest))
            return
        if target is not None or lane is not None:
            self._steer_failed(
                steer,
                None,
                "response_already_completed" if target is None else "response_not_active",
                "The response is no longer accepting steering input.",
                lane,
            )
            return
        self._steer_failed(
            steer,
            None,
            "response_not_found",
            f"No response '{steer.previous_response_id}' is active on this connection.",
            None,
        )

    def _steer_failed(
        self, steer: rp.Steer, steer_id: str | None, code: str, message: str, lane: Lane | None
    ) -> None:
        event = turns.steer_failed(steer, steer_id, code, message)
        if lane is not None:
            self._put(lane, event)
        else:
            self.core.outbox.put(event)

    def _settle_steers(
        self,
        lane: Lane,
        turn: Turn,
        response_id: str,
        status: str,
        calls: tuple[tuple[str, str], ...],
    ) -> None:
        """What becomes of steering input accepted for a response that just ended."""
        steers, turn.steers = turn.steers, []
        if not steers:
            return
        if status in ("cancelled", "failed") or self.core.closing:
            for steer_id, steer in steers:
                self._steer_failed(
                    steer,
                    steer_id,
                    "response_not_active",
                    "The response ended without a successor: send it in a new response.create.",
                    lane,
                )
            return
        if calls:  # it waits for tool output: the input goes with the next create
            lane.pending_steers.extend(steers)
            assert lane.latest is not None
            for steer_id, _ in steers:
                self._put(lane, turns.steer_pending(steer_id, lane.latest))
            return
        # The successor: the same settings, continuing this response with the input.
        successor = replace(turn.body, input=(), previous_response_id=response_id, generate=True)
        try:
            self._start(lane, successor, steers)
        except errors.ProtocolError as err:
            for steer_id, steer in steers:
                self._steer_failed(steer, steer_id, "successor_creation_failed", err.message, lane)


_STEERED = "steer"
