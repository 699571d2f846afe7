"""What the session store queues for Redis between flushes, and the commands a flush sends.

redis_store.py queues each session's writes here (a list append on the token path);
each lane's flush takes them all and turns them into script calls
(gateway/cluster/store_scripts.py): one call per hash slot (one for everything on one
server or Sentinel; one per slot in a cluster, each on its slot's node), sessions and
their statuses in the same order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.crc import key_slot

from gateway.cluster import store_scripts

PREFIX = "llmgw:"


# A session's keys share its id as their hash tag ({...}): one slot in a cluster.
def state_key(session_id: str) -> str:
    return f"{PREFIX}s:{{{session_id}}}"


def log_key(session_id: str) -> str:
    return f"{PREFIX}l:{{{session_id}}}"


def owner_key(session_id: str) -> str:
    return f"{PREFIX}o:{{{session_id}}}"


def response_key(response_id: str) -> str:
    return f"{PREFIX}r:{response_id}"


def background_key(response_id: str) -> str:
    return f"{PREFIX}b:{response_id}"


def channel(process: str) -> str:
    """The relay channel of a process (sharded in a cluster: its name is its slot)."""
    return f"{PREFIX}i:{{{process}}}"


def token_process(token: str) -> str:
    """The process a lease's token names (``PROCESS#N``)."""
    return token.rpartition("#")[0] or token


@dataclass(slots=True)
class LogWrites:
    """What one session has for the log lane at its next flush."""

    frames: list[tuple[int, bytes]] = field(default_factory=list)
    token_ids: dict[int, bytes] = field(default_factory=dict)  # by frame number
    trim_before: int | None = None
    check: bool = False  # no frames, but see that the log holds all it should

    def follow(self, older: LogWrites) -> None:
        """Take in ``older`` (what a failed flush took), ahead of what was queued since."""
        self.frames[:0] = older.frames
        self.token_ids.update(older.token_ids)
        self.trim_before = self.trim_before or older.trim_before
        self.check = self.check or older.check


@dataclass(slots=True)
class StateWrites:
    """What one session has for the state lane at its next flush."""

    token: str = ""
    state: Callable[[], bytes] | None = None  # serialized at flush time: once per flush
    take: str = ""  # "n": a new session's lease; "r": this process's again
    renew: bool = False
    release_for: float | None = None  # let go of the lease; the keys live this long
    forget: bool = False

    def follow(self, older: StateWrites) -> None:
        """Take in ``older`` (what a failed flush took), ahead of what was queued since."""
        self.token = self.token or older.token
        self.state = self.state or older.state
        self.take = self.take or older.take
        self.renew = self.renew or older.renew
        if self.release_for is None:
            self.release_for = older.release_for
        self.forget = self.forget or older.forget


W = TypeVar("W", LogWrites, StateWrites)


def put_back(queue: dict[str, W], taken: dict[str, W]) -> None:
    """What a failed flush took, queued again ahead of what was queued since."""
    for session_id, old in taken.items():
        new = queue.get(session_id)
        if new is None:
            queue[session_id] = old
        else:
            new.follow(old)


Groups = dict[str, list[list[str]]]  # node -> sessions of one slot each
NodeOf = Callable[[int], str]


def groups(session_ids: Iterable[str], node_of_slot: NodeOf | None) -> Groups:
    """``session_ids`` by node and slot (None: one node, one group)."""
    if node_of_slot is None:
        ids = list(session_ids)
        return {"": [ids]} if ids else {}
    by_slot: dict[int, list[str]] = defaultdict(list)
    for session_id in session_ids:
        by_slot[key_slot(session_id.encode())].append(session_id)
    out: Groups = defaultdict(list)
    for slot, ids in by_slot.items():
        out[node_of_slot(slot)].append(ids)
    return out


def append_args(
    session_id: str, writes: LogWrites, token: str, take: str, prev: int | None
) -> list[Any]:
    """One session's part of an APPEND call's arguments."""
    frames = writes.frames
    ids = b""
    if frames and writes.token_ids:
        ids = b"\n".join(writes.token_ids.get(seq, b"") for seq, _ in frames)
    return [
        token,
        take,
        "" if prev is None else prev,
        frames[0][0] if frames else "",
        b"\n".join(frame for _, frame in frames),
        ids,
        "" if writes.trim_before is None else writes.trim_before,
    ]


def save_args(writes: StateWrites) -> list[Any]:
    """One session's part of a SAVE call's arguments."""
    return [
        writes.token,
        writes.state() if writes.state is not None else "",
        writes.take,
        "1" if writes.renew else "",
        "" if writes.release_for is None else max(1, int(1000 * writes.release_for)),
        "1" if writes.forget else "",
    ]


Call = Callable[[list[Any], list[tuple[str, list[Any]]]], tuple[Any, ...]]


def calls(
    call: Call, head: list[Any], parts: dict[str, list[Any]], node_of_slot: NodeOf | None
) -> tuple[dict[str, list[tuple[Any, ...]]], Groups]:
    """A flush's script calls (``call``: :func:`append_call` or :func:`save_call`) by node,
    one per slot, and the sessions of each, in the order of the statuses it returns."""
    commands: dict[str, list[tuple[Any, ...]]] = {}
    order: Groups = {}
    for node, slot_groups in groups(parts, node_of_slot).items():
        commands[node] = [call(head, [(s, parts[s]) for s in g]) for g in slot_groups]
        order[node] = slot_groups
    return commands, order


def script_call(sha: str, keys: list[str], head: list[Any], args: list[Any]) -> tuple[Any, ...]:
    return ("EVALSHA", sha, len(keys), *keys, *head, *args)


def append_call(head: list[Any], parts: list[tuple[str, list[Any]]]) -> tuple[Any, ...]:
    keys: list[str] = []
    args: list[Any] = []
    for session_id, part in parts:
        keys += (log_key(session_id), owner_key(session_id))
        args += part
    return script_call(store_scripts.APPEND_SHA, keys, head, args)


def save_call(head: list[Any], parts: list[tuple[str, list[Any]]]) -> tuple[Any, ...]:
    keys: list[str] = []
    args: list[Any] = []
    for session_id, part in parts:
        keys += (state_key(session_id), owner_key(session_id), log_key(session_id))
        args += part
    return script_call(store_scripts.SAVE_SHA, keys, head, args)
