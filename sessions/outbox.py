"""Per-session event log between the session (and scheduler) and the session's socket.

The outbox is the one path to a session's socket, and it owns the order:

- Every server event gets the session's next ``sequence_number`` (and an
  ``event_id`` derived from it) at the moment it is written, so numbers run
  1, 2, 3... with no gap on whatever socket carries them.
- Written frames stay in a bounded replay buffer, so a client that lost its
  connection can resume after the last number it saw (``replay_after``).
- An event goes straight to the socket, from the caller's own stack, when
  nothing is pending and the socket has room: the common case costs no task
  wake-up. Only when the socket pushes back does a writer task appear, for as
  long as it takes to drain what is pending.
- While the socket pushes back (or no socket is attached), consecutive text
  deltas of one response merge into one pending delta, like vLLM's
  ``RequestOutputCollector``: a slow reader costs memory proportional to the
  text, not to the number of tokens, and the joined text is unchanged. A
  response that asked for log probabilities keeps them with its text: the merged
  delta carries every merged token's, in order (counted against the byte cap).
  Anything else a client can make pile up is capped: past the cap the outbox
  drops what is pending, marks itself ``lost`` and calls ``on_overflow``.

Nothing here imports the network (the socket end is a :class:`Wire`) or knows a
wire format: the session's dialect gives a :class:`Framing`, which splices the
number into an event and builds the one event per token, a text delta, from a
template it makes once per response (with its tokens' log probabilities, for a
response that asked for them).

The common case, a token for a socket with room, is :meth:`Outbox.put_delta`'s first
branch: a number, the framing's template, the replay buffer's append and one write, in
one function (see docs/performance.md, "The token path").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.engines.base import TokenLogprob
from sessions.codec import JSON, encode

# Rough memory costs, so the byte cap means memory: a pending delta's event fields,
# and each merged piece of text (a str object and its list slot).
_DELTA_OVERHEAD = 160
_PART_OVERHEAD = 64
_MAX_PARTS = 256
# A token's log probability: its object and text, and each of its alternatives.
_LOGPROB_OVERHEAD = 120
_TOP_LOGPROB_OVERHEAD = 100


class Framing(Protocol):
    """How one dialect's events carry their number, and its text delta's bytes."""

    first_sequence_number: int
    replays_first: bool  # False: the first event is never replayed (Realtime's greeting)

    def numbered(self, seq: int, body: bytes) -> bytes:
        """The encoded event ``body`` (a JSON object) with its number ``seq`` added."""

    def delta_ids(self, response_id: str, item_id: str) -> bytes:
        """What :meth:`delta` builds a response's text deltas from (made once per
        response: a template naming it, say)."""

    def delta(self, seq: int, ids: bytes, text: str) -> bytes:
        """The text delta ``text`` of output 0 of the response ``ids`` names, numbered."""

    def delta_logprobs(
        self, seq: int, ids: bytes, text: str, logprobs: Sequence[TokenLogprob]
    ) -> bytes:
        """The same, with its tokens' log probabilities (a response that asked for them)."""


class Wire(Protocol):
    """The socket end of an outbox (gateway/server.py implements it over websockets)."""

    def writable(self) -> bool:
        """True if :meth:`write` cannot block now."""

    def write(self, frame: bytes) -> None:
        """Send one text frame at once (only called when :meth:`writable`)."""

    async def write_later(self, frame: bytes) -> None:
        """Send one frame once the socket has room; returns (dropping it) if the
        connection is gone."""

    def close(self, code: int, reason: str) -> None:
        """Close the connection after what was written, without waiting here."""


@dataclass(slots=True)
class _PendingDelta:
    response_id: str
    item_id: str
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the parts' (see put_delta)
    logprobs: list[TokenLogprob] | None = None  # the parts' tokens', when asked for
    logprob_bytes: int = 0  # what they count against the byte cap


@dataclass(frozen=True, slots=True)
class _Numbered:
    """A frame that already carries its number (replayed), or none by design."""

    frame: bytes


@dataclass(frozen=True, slots=True)
class CloseRequest:
    """Tells the writer to close the socket with this code once it gets here."""

    code: int
    reason: str


_Entry = bytes | _PendingDelta | _Numbered | CloseRequest


@dataclass(frozen=True, slots=True)
class OutboxStats:
    deltas_in: int = 0  # deltas handed to the outbox
    frames_out: int = 0  # frames numbered for the socket (written, or kept for a resume)
    delta_frames_out: int = 0  # of which text deltas (fewer than deltas_in when coalescing)
    bytes_out: int = 0


class ReplayBudget:
    """Bytes of replay buffer that all sessions together may hold."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class Outbox:
    def __init__(
        self,
        framing: Framing,
        *,
        max_pending: int = 2048,
        max_pending_bytes: int = 16 << 20,
        coalesce: bool = True,
        replay_bytes: int = 256 << 10,
        replay_budget: ReplayBudget | None = None,
        unread: bool = False,
    ) -> None:
        """``unread``: no socket will ever read these events (a one-shot HTTP answer, whose
        handler waits for its result alone): each is dropped as it comes, unencoded."""
        # Lists with a head index rather than deques: an idle session's outbox is then a few
        # hundred bytes smaller (a deque keeps a 64-slot block even when empty). Each is
        # cleared when its head reaches the end, so "not self._pending" means empty.
        self._pending: list[_Entry] = []
        self._head = 0
        self._replayed = 0  # _Numbered entries pending: not counted against max_pending
        # Deltas still mergeable, by response. Cleared by any other event, so each
        # response's events keep their order on the wire.
        self._open: dict[str, _PendingDelta] = {}
        self._bytes = 0
        self._max_pending = max_pending
        self._max_bytes = max_pending_bytes
        self._pending_limit = max_pending_bytes  # lower while detached: see detach()
        self._coalesce = coalesce
        self._wire: Wire | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closed = unread  # accepts nothing: what put and put_delta look at first
        self._framing = framing
        self._seq = framing.first_sequence_number - 1
        self._seq_start = self._seq  # frames numbered here: _seq - _seq_start
        # Sent frames from _replay_head on: the run of numbers that ends at _seq (every
        # numbered frame is kept, but a greeting that is never replayed, which comes first).
        # A list with a head index, not a deque, for the reason above.
        self._replay: list[bytes] = []
        self._replay_head = 0
        self._replay_bytes = 0
        self._delta_response: str | None = None  # whose ids _delta_ids holds
        self._delta_item: str | None = None
        self._delta_ids = b""
        self._replays_first = framing.replays_first
        self._replay_limit = replay_bytes
        self._budget = replay_budget or ReplayBudget(replay_bytes)
        self._deltas_in = 0
        self._delta_frames = 0
        self._bytes_out = 0
        self.lost = False  # events were dropped: a resume cannot be seamless any more
        self.on_overflow: Callable[[], None] | None = None
        # Told of every numbered frame (a session store logs it; it must not await).
        self.on_sent: Callable[[int, bytes], None] | None = None
        # Told, right after on_sent, of a delta frame's token ids, where the engine gave
        # them (TensorRT-LLM continues an answer from them after a takeover).
        self.on_token_ids: Callable[[int, tuple[int, ...]], None] | None = None
        self.on_attach: Callable[[Wire], None] | None = None  # a wire starts serving here

    def __len__(self) -> int:
        return len(self._pending) - self._head - self._replayed

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    @property
    def stats(self) -> OutboxStats:
        """What was numbered and sent so far (counted on the hot path: a few additions)."""
        frames = self._seq - self._seq_start
        return OutboxStats(self._deltas_in, frames, self._delta_frames, self._bytes_out)

    @property
    def last_sequence_number(self) -> int:
        return self._seq

    @property
    def wire(self) -> Wire | None:
        """The socket end events go to now (None while the session is detached)."""
        return self._wire

    # -- putting events --------------------------------------------------------------

    def put(self, server_event: JSON) -> None:
        """Queue (or send right away) one server event; it gets its number when written."""
        if self._closed:
            return
        if self._open:
            self._open.clear()
        body = encode(server_event)
        wire = self._wire
        if not self._pending and self._writer is None and wire is not None and wire.writable():
            self._seq = seq = self._seq + 1
            frame = self._framing.numbered(seq, body)
            self._sent(seq, frame)
            wire.write(frame)
        else:
            self._append(body, len(body))

    def put_delta(
        self,
        response_id: str,
        item_id: str,
        text: str,
        token_ids: tuple[int, ...] = (),
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        """Queue (or send) one text delta; ``token_ids``: the tokens it was decoded from,
        if the engine gave them, told to ``on_token_ids`` with the frame that carries it;
        ``logprobs``: their log probabilities, for a response that asked (None otherwise:
        a response's deltas all have them or none do)."""
        if self._closed:
            return
        self._deltas_in += 1
        wire = self._wire
        if not self._pending and self._writer is None and wire is not None and wire.writable():
            # The hot path: one token, straight to the socket. What _number and _sent do
            # for any frame, inline (a delta is never the greeting, which goes first).
            self._seq = seq = self._seq + 1
            if response_id is not self._delta_response or item_id is not self._delta_item:
                self._new_delta_ids(response_id, item_id)
            if logprobs is None:
                frame = self._framing.delta(seq, self._delta_ids, text)
            else:
                frame = self._framing.delta_logprobs(seq, self._delta_ids, text, logprobs)
            if self.on_sent is not None:
                self.on_sent(seq, frame)
            size = len(frame)
            self._bytes_out += size
            self._delta_frames += 1
            if self._replay_limit:
                self._replay.append(frame)
                self._replay_bytes += size
                budget = self._budget
                budget.used += size
                if self._replay_bytes > self._replay_limit or budget.used > budget.limit:
                    self._evict()
            if token_ids and self.on_token_ids is not None:
                self.on_token_ids(seq, token_ids)
            wire.write(frame)
            return
        pending = self._open.get(response_id) if self._coalesce else None
        if pending is not None:
            pending.parts.append(text)
            pending.token_ids += token_ids
            self._bytes += len(text) + _PART_OVERHEAD
            if logprobs is not None:
                self._bytes += _keep_logprobs(pending, logprobs)
            if len(pending.parts) >= _MAX_PARTS:  # one string, not thousands of small ones
                self._bytes -= _PART_OVERHEAD * (len(pending.parts) - 1)
                pending.parts = ["".join(pending.parts)]
            self._check_limits()
            return
        pending = _PendingDelta(response_id, item_id, [text], list(token_ids))
        size = len(text) + _DELTA_OVERHEAD
        if logprobs is not None:
            size += _keep_logprobs(pending, logprobs)
        self._open[response_id] = pending
        self._append(pending, size)

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Send what is pending, then close the socket with ``code``; accept nothing more."""
        if self._closed:
            return
        self._closed = True
        self._pending.append(CloseRequest(code, reason))
        self._kick()

    # -- the socket ----------------------------------------------------------------

    def abandon(self) -> Wire | None:
        """Stop at once: what is pending is dropped, nothing more is written, and the
        wire is let go (returned: its caller closes it as it must). A session store does
        this when another process has taken the session over (gateway/cluster/)."""
        self._closed = True
        self._pending.clear()
        self._head = 0
        self._replayed = 0
        self._open.clear()
        self._bytes = 0
        if self._writer is not None:
            self._writer.cancel()
            self._writer = None
        wire, self._wire = self._wire, None
        return wire

    def attach(self, wire: Wire, first: Sequence[bytes] = ()) -> None:
        """Send to ``wire`` from now on: ``first`` (frames already numbered, or never
        numbered), then whatever is pending. A wire attached before is closed (4001)."""
        old, self._wire = self._wire, wire
        if self.on_attach is not None:
            self.on_attach(wire)
        self._pending_limit = self._max_bytes
        if old is not None:
            old.close(4001, "the session was resumed on another connection")
        if self._writer is not None:
            # Busy with a frame for a socket that is gone or going: that frame is
            # numbered and in the replay buffer already. Waiting for it would hold this
            # socket until the old one's close times out.
            self._writer.cancel()
            self._writer = None
        # Frames numbered already but never sent (a replay for an earlier socket, its
        # session.resumed) are not this socket's: the replay it asked for is ``first``.
        unsent = [e for e in self._pending[self._head :] if not isinstance(e, _Numbered)]
        self._pending = [*(_Numbered(frame) for frame in first), *unsent]
        self._head = 0
        self._replayed = len(first)
        self._kick()

    def detach(self, wire: Wire) -> None:
        """``wire`` is gone: keep events pending until another attaches (or the end)."""
        if self._wire is wire:
            self._wire = None
            # What waits for a resume is held to the replay buffer's size.
            self._pending_limit = min(self._max_bytes, self._replay_limit)
            self._check_limits()

    def replay_after(self, last_sequence_number: int) -> list[bytes] | None:
        """The frames numbered above ``last_sequence_number``, or None if some of them
        are no longer kept (or were never sent)."""
        first = self._framing.first_sequence_number
        if self.lost or not first - 1 <= last_sequence_number <= self._seq:
            return None
        first_kept = self.first_kept
        if last_sequence_number + 1 < first_kept:
            return None
        return self._replay[self._replay_head + last_sequence_number + 1 - first_kept :]

    @property
    def first_kept(self) -> int:
        """The number of the oldest frame still kept for a replay (the next one if none)."""
        return self._seq + 1 - (len(self._replay) - self._replay_head)

    def seed(self, frames: Sequence[tuple[int, bytes]]) -> None:
        """Start from a log another process wrote (a takeover): its numbers go on after
        the last of ``frames``, which are kept for a replay. Only the run of numbers that
        ends the log is kept (a gap before it is lost)."""
        if not frames:
            return
        start = len(frames) - 1
        while start > 0 and frames[start - 1][0] == frames[start][0] - 1:
            start -= 1
        kept = frames[start:]
        self._seq = self._seq_start = kept[-1][0]
        self._replay = [frame for _, frame in kept]
        self._replay_head = 0
        self._replay_bytes = sum(len(frame) for frame in self._replay)
        self._budget.used += self._replay_bytes

    def release(self) -> None:
        """The session ended: give the replay buffer's bytes back to the shared budget.
        What is pending stays for the writer to send (a slow reader's last
        ``response.done`` and the close frame), up to the close request."""
        self._budget.used -= self._replay_bytes
        self._replay = []
        self._replay_head = 0
        self._replay_bytes = 0

    # -- internals -------------------------------------------------------------------

    def _append(self, entry: _Entry, size: int) -> None:
        self._pending.append(entry)
        self._bytes += size
        self._check_limits()
        self._kick()

    def _kick(self) -> None:
        """Write what can be written now; leave the rest to a writer task."""
        if self._writer is not None or self._wire is None:
            return
        self._flush()
        if self._pending and self._wire is not None:
            self._writer = asyncio.get_running_loop().create_task(self._write_blocked())

    def _flush(self) -> None:
        wire = self._wire
        while self._pending and wire is not None and wire.writable():
            self._write(self._take())

    async def _write_blocked(self) -> None:
        """Drain what is pending while the socket pushes back; ends when all is sent."""
        try:
            while self._pending and (wire := self._wire) is not None:
                entry = self._take()
                if isinstance(entry, CloseRequest):
                    self._write(entry)
                    return
                await wire.write_later(self._number(entry))
                self._flush()
        finally:
            if self._writer is asyncio.current_task():  # not a successor attach() started
                self._writer = None

    def _take(self) -> _Entry:
        pending, head = self._pending, self._head
        entry, self._head = pending[head], head + 1
        if self._head == len(pending):
            pending.clear()
            self._head = 0
        elif self._head >= 64 and 2 * self._head >= len(pending):
            del pending[: self._head]
            self._head = 0
        if isinstance(entry, bytes):
            self._bytes -= len(entry)
        elif isinstance(entry, _Numbered):
            self._replayed = max(0, self._replayed - 1)
        elif isinstance(entry, _PendingDelta):
            # Taking a delta ends its mergeability: later text goes into a new frame.
            if self._open.get(entry.response_id) is entry:
                del self._open[entry.response_id]
            self._bytes -= sum(map(len, entry.parts)) + _PART_OVERHEAD * (len(entry.parts) - 1)
            self._bytes -= _DELTA_OVERHEAD + entry.logprob_bytes
        return entry

    def _write(self, entry: _Entry) -> None:
        wire = self._wire
        assert wire is not None
        if isinstance(entry, CloseRequest):
            self._pending.clear()
            self._head = 0
            self._replayed = 0
            self._wire = None
            wire.close(entry.code, entry.reason)
            return
        wire.write(self._number(entry))

    def _number(self, entry: bytes | _PendingDelta | _Numbered) -> bytes:
        """The frame for ``entry`` with the session's next number, kept for replay."""
        if isinstance(entry, _Numbered):
            return entry.frame
        self._seq += 1
        seq = self._seq
        if isinstance(entry, _PendingDelta):
            if (
                entry.response_id is not self._delta_response
                or entry.item_id is not self._delta_item
            ):
                self._new_delta_ids(entry.response_id, entry.item_id)
            text = "".join(entry.parts)
            if entry.logprobs is None:
                frame = self._framing.delta(seq, self._delta_ids, text)
            else:
                frame = self._framing.delta_logprobs(seq, self._delta_ids, text, entry.logprobs)
            self._delta_frames += 1
            self._sent(seq, frame)
            if entry.token_ids and self.on_token_ids is not None:
                self.on_token_ids(seq, tuple(entry.token_ids))
            return frame
        frame = self._framing.numbered(seq, entry)
        self._sent(seq, frame)
        return frame

    def _new_delta_ids(self, response_id: str, item_id: str) -> None:
        """Delta frames are built from bytes, one per token; the part naming the
        response is made once per response."""
        self._delta_response, self._delta_item = response_id, item_id
        self._delta_ids = self._framing.delta_ids(response_id, item_id)

    def _sent(self, seq: int, frame: bytes) -> None:
        """Count ``frame`` (numbered ``seq``) and keep it for a resume (put_delta's hot
        path does the same inline)."""
        if self.on_sent is not None:
            self.on_sent(seq, frame)
        size = len(frame)
        self._bytes_out += size
        # Resume off, or a greeting (Realtime's session.created): a client that did not get
        # it has no session id or token to resume with, so it is never replayed.
        if not self._replay_limit or (
            seq == self._framing.first_sequence_number and not self._replays_first
        ):
            return
        self._replay.append(frame)
        self._replay_bytes += size
        budget = self._budget
        budget.used += size
        if self._replay_bytes > self._replay_limit or budget.used > budget.limit:
            self._evict()

    def _evict(self) -> None:
        """The oldest kept frames go until this buffer and all of them fit their limits."""
        replay, budget = self._replay, self._budget
        head = self._replay_head
        while self._replay_bytes > self._replay_limit or budget.used > budget.limit:
            old = len(replay[head])
            replay[head] = b""  # gone: its memory, at once
            head += 1
            self._replay_bytes -= old
            budget.used -= old
            if head == len(replay):
                replay.clear()
                head = 0
                break
        if head >= 64 and 2 * head >= len(replay):
            del replay[:head]  # what is gone leaves the list (a copy of the rest, now and then)
            head = 0
        self._replay_head = head

    def _check_limits(self) -> None:
        if len(self) > self._max_pending or self._bytes > self._pending_limit:
            self._overflow()

    def _overflow(self) -> None:
        """Too much is pending (the client does not read, or is gone): drop it all."""
        self._pending.clear()
        self._head = 0
        self._replayed = 0
        self._open.clear()
        self._bytes = 0
        self.lost = True
        self.release()  # no resume can be seamless now: the replay buffer is useless
        self._closed = True
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.close(1008, "client is not reading its events")
        if self.on_overflow is not None:
            self.on_overflow()


def _keep_logprobs(pending: _PendingDelta, logprobs: Sequence[TokenLogprob]) -> int:
    """Add ``logprobs`` to what ``pending`` carries, after the earlier parts' (merging
    keeps every token's, in order); returns the bytes they count."""
    if pending.logprobs is None:
        pending.logprobs = list(logprobs)
    else:
        pending.logprobs += logprobs
    size = sum(
        _LOGPROB_OVERHEAD + len(lp.token) + _TOP_LOGPROB_OVERHEAD * len(lp.top) for lp in logprobs
    )
    pending.logprob_bytes += size
    return size
