"""Stored responses and background records: the session store's keys no session owns.

A stored Responses response (``r:ID``, ``store: true``) and a background response's
record (``b:ID``, gateway/cluster/background.py) are written plain (``SET`` with a TTL,
or ``DEL``), not through the lease-checking scripts: they outlive the session that made
them and no lease fences them. They are queued here and leave with the state lane's next
flush (redis_store.py), in the order they were queued.
"""

from __future__ import annotations

from typing import Any

from gateway.cluster.store_lanes import Lane
from gateway.cluster.store_writes import background_key, response_key

Queued = list[tuple[str, bytes | None, float]]  # (key, data or None: delete, seconds)


class ResponseWrites:
    """The queue of stored responses and background records, for ``lane``'s flushes."""

    def __init__(self, lane: Lane) -> None:
        self._lane = lane
        self._queued: Queued = []
        # The flush that writes the latest put: a held frame waits for it (the response
        # it names must be there for a client that resumes elsewhere).
        self.due = 0

    def put_response(self, response_id: str, data: bytes, ttl: float) -> None:
        self._put(response_key(response_id), data, ttl)

    def delete_response(self, response_id: str) -> None:
        self._delete(response_key(response_id))

    def put_background(self, response_id: str, data: bytes, ttl: float) -> None:
        self._put(background_key(response_id), data, ttl)

    def delete_background(self, response_id: str) -> None:
        self._delete(background_key(response_id))

    def _put(self, key: str, data: bytes, ttl: float) -> None:
        self._queued.append((key, data, ttl))
        self.due = self._lane.next
        self._lane.wake.set()

    def _delete(self, key: str) -> None:
        self._queued.append((key, None, 0))
        self._lane.wake.set()

    def take(self) -> Queued:
        """What the lane's next flush writes."""
        taken, self._queued = self._queued, []
        return taken

    def requeue(self, taken: Queued) -> None:
        """A flush that failed: what it took goes first again."""
        self._queued[:0] = taken


def command(key: str, data: bytes | None, seconds: float) -> tuple[Any, ...]:
    return ("DEL", key) if data is None else ("SET", key, data, "PX", max(1, int(1000 * seconds)))
