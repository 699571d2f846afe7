"""The ordered items of one conversation; changed only by its session actor."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engines.base import Message, Role
from gateway.protocol import JSON, message_item

ItemStatus = str  # "completed" | "incomplete" | "in_progress"


@dataclass(slots=True)
class Item:
    id: str
    role: Role
    text: str
    status: ItemStatus = "completed"

    def to_json(self) -> JSON:
        return message_item(self.id, self.role, self.text, self.status)


class DuplicateItemId(KeyError):
    """An item with this id is already in the conversation (whoever made either id)."""


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

    def get(self, item_id: str) -> Item | None:
        return self._by_id.get(item_id)

    def last_id(self) -> str | None:
        return self._items[-1].id if self._items else None

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
            self._items.insert(self._items.index(self._by_id[after]) + 1, item)
        self._by_id[item.id] = item
        self.chars += len(item.text)

    def finish(self, item_id: str, text: str, status: ItemStatus) -> None:
        """Give a generated item its final text and status (if it is still there)."""
        item = self._by_id.get(item_id)
        if item is not None:
            self.chars += len(text) - len(item.text)
            item.text, item.status = text, status

    def delete(self, item_id: str) -> Item:
        item = self._by_id.pop(item_id)
        self._items.remove(item)
        self.chars -= len(item.text)
        return item

    def to_messages(self) -> list[Message]:
        """What the engine sees: every finished item with text, in order."""
        return [
            Message(i.role, i.text) for i in self._items if i.text and i.status != "in_progress"
        ]
