"""The ordered items of one conversation; changed only by its session.

Items are messages, the function calls a model made and the outputs a client
returned for them. :meth:`Conversation.to_messages` turns them into the chat
turns engines take: calls join the assistant turn they follow, outputs become
``tool`` messages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from gateway.engines.base import Message, Role, ToolCall
from sessions.errors import DuplicateItemId

ItemStatus = str  # "completed" | "incomplete" | "in_progress"
ItemKind = Literal["message", "function_call", "function_call_output"]


@dataclass(slots=True)
class Item:
    """One conversation item. ``text`` is a message's text, a call's arguments (JSON text)
    or a call's output; ``call_id`` and ``name`` belong to calls and outputs."""

    id: str
    role: Role
    text: str
    status: ItemStatus = "completed"
    kind: ItemKind = "message"
    call_id: str | None = None
    name: str | None = None

    @classmethod
    def function_call(
        cls, item_id: str, call_id: str, name: str, arguments: str, status: ItemStatus
    ) -> Item:
        return cls(item_id, "assistant", arguments, status, "function_call", call_id, name)

    @classmethod
    def function_call_output(cls, item_id: str, call_id: str, output: str) -> Item:
        return cls(item_id, "tool", output, "completed", "function_call_output", call_id)


class Conversation:
    """Items in order, addressable by id; ``chars`` is the text they hold, for limits."""

    def __init__(self) -> None:
        self._items: list[Item] = []
        self._by_id: dict[str, Item] = {}
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._by_id

    def items(self) -> list[Item]:
        """Every item, in order."""
        return list(self._items)

    def get(self, item_id: str) -> Item | None:
        return self._by_id.get(item_id)

    def last_id(self) -> str | None:
        return self._items[-1].id if self._items else None

    def has_call(self, call_id: str) -> bool:
        """Whether a function call with this ``call_id`` is in the conversation."""
        return any(i.kind == "function_call" and i.call_id == call_id for i in self._items)

    def insert(self, item: Item, after: str | None = None) -> None:
        """Append, or insert after item ``after`` (``"root"``: first).

        Raises :class:`DuplicateItemId` if the id is taken, and ``KeyError`` if ``after``
        is missing; either way the conversation is unchanged.
        """
        if item.id in self._by_id:
            raise DuplicateItemId(item.id)
        if after is None:
            self._items.append(item)
        elif after == "root":
            self._items.insert(0, item)
        else:
            self._items.insert(self._index(self._by_id[after]) + 1, item)
        self._by_id[item.id] = item
        self.chars += len(item.text)

    def _index(self, item: Item) -> int:
        """Where ``item`` (one of ours) is: searched by identity from the end, where the
        items a response adds go (``list.index`` would compare every field of each)."""
        items = self._items
        index = len(items) - 1
        while items[index] is not item:
            index -= 1
        return index

    def finish(self, item_id: str, text: str, status: ItemStatus) -> None:
        """Give a generated item its final text and status (if it is still there)."""
        item = self._by_id.get(item_id)
        if item is not None:
            self.chars += len(text) - len(item.text)
            item.text, item.status = text, status

    def delete(self, item_id: str) -> Item:
        item = self._by_id.pop(item_id)
        del self._items[self._index(item)]
        self.chars -= len(item.text)
        return item

    def to_messages(self) -> list[Message]:
        """What the engine sees: every finished item with content, in order."""
        return items_to_messages(self._items)


def items_to_messages(items: list[Item]) -> list[Message]:
    """Chat turns for ``items``, in order.

    Completed calls join the assistant turn right before them (a model's text and
    the calls it then made are one turn); an output becomes a ``tool`` message.
    A call cut short (its arguments are not valid JSON) and the outputs of calls
    that are not there are left out: chat templates and servers refuse them.
    """
    calls = {i.call_id for i in items if i.kind == "function_call" and i.status == "completed"}
    messages: list[Message] = []
    for item in items:
        if item.status == "in_progress":
            continue
        if item.kind == "function_call":
            if item.status != "completed":
                continue
            call = ToolCall(item.call_id or "", item.name or "", item.text)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(Message("assistant", "", (call,)))
        elif item.kind == "function_call_output":
            if item.call_id in calls:
                messages.append(Message("tool", item.text, tool_call_id=item.call_id))
        elif item.text:
            messages.append(Message(item.role, item.text))
    return messages
