"""Stored Responses-API responses, for ``previous_response_id`` from any connection.

One store per gateway process, shared by every session of the Responses dialect
(WebSocket and HTTP). Bounded in bytes per tenant (``max_bytes`` each: a tenant's
own oldest go first, so a busy tenant never pushes out another's) and in time (each
expires ``ttl`` seconds after it was stored); expired entries are dropped as they
are met and from the front on every put, so nothing outlives its TTL by much. Tenants
are the configured keys' (gateway/api/auth.py): a bounded number of budgets.
Only the session actors and the HTTP routes call it, all on the event loop thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from sessions.codec import JSON
from sessions.conversation import Item

_ITEM_BYTES = 200  # an Item and its strings' headers, roughly
_REFERENCE_BYTES = 8  # a history shares its items with its predecessor's
_BODY_BYTES = 1024  # a Response object's fields beside its output


@dataclass(eq=False, slots=True)
class StoredResponse:
    """A finished response: what continues it, and what ``GET`` shows of it."""

    id: str
    body: JSON  # the Response object, as its terminal event carried it
    history: tuple[Item, ...]  # every item of the conversation it ends, its output last
    input_items: tuple[Item, ...]  # what its own request sent
    pending_calls: tuple[tuple[str, str], ...] = ()  # (call_id, name) awaiting output
    tenant: str = ""  # who stored it: no other tenant can read, continue or delete it
    size: int = field(default=0)

    def __post_init__(self) -> None:
        # The body repeats the output's text; its other fields are a few hundred bytes.
        own = sum(len(i.text) + _ITEM_BYTES for i in self.input_items)
        outputs = self.history[len(self.history) - len(self.body.get("output") or ()) :]
        output = sum(len(i.text) + _ITEM_BYTES for i in outputs)
        self.size = own + output + _REFERENCE_BYTES * len(self.history) + _BODY_BYTES


class ResponseStore:
    def __init__(
        self, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        # Every entry, oldest first (all live for the same ttl: the expiry order too), and
        # each tenant's, oldest first, with its bytes (what its budget evicts from).
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._tenant_bytes: dict[str, int] = {}
        self.bytes = 0
        # A session store's hooks (gateway/cluster/persistence.py): what is put or deleted here
        # is put or deleted there too, for every process sharing it.
        self.on_put: Callable[[StoredResponse], None] | None = None
        self.on_delete: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: StoredResponse, *, notify: bool = True) -> None:
        """Keep ``response``; ``notify``: tell the session store (not for what came from it)."""
        if notify and self.on_put is not None:
            self.on_put(response)
        if response.size > self.max_bytes or self.ttl <= 0:
            return
        self.delete(response.id)
        now = self._clock()
        tenant = response.tenant
        self._entries[response.id] = (now + self.ttl, response)
        self._by_tenant.setdefault(tenant, OrderedDict())[response.id] = response
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + response.size
        self.bytes += response.size
        self._expire(now)
        own = self._by_tenant[tenant]
        while self._tenant_bytes[tenant] > self.max_bytes:
            self.delete(next(iter(own)))

    def tenant_bytes(self, tenant: str) -> int:
        """What ``tenant``'s stored responses take of its budget."""
        return self._tenant_bytes.get(tenant, 0)

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """``response_id`` if ``tenant`` stored it: another tenant gets what an unknown id
        gets (None), so that an id seen in a log or a URL opens nothing."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self.delete(response_id)
            return None
        return entry[1] if entry[1].tenant == tenant else None

    def __contains__(self, response_id: str) -> bool:
        """Whether this process holds ``response_id`` (whoever's): for caching only."""
        return response_id in self._entries

    def delete(self, response_id: str, *, notify: bool = False) -> bool:
        if notify and self.on_delete is not None:
            self.on_delete(response_id)
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        response = entry[1]
        self.bytes -= response.size
        own = self._by_tenant[response.tenant]
        del own[response_id]
        left = self._tenant_bytes.pop(response.tenant) - response.size
        if own:
            self._tenant_bytes[response.tenant] = left
        else:
            del self._by_tenant[response.tenant]
        return True

    def _expire(self, now: float) -> None:
        # Entries are in the order they were stored, and all live for the same ttl.
        while self._entries:
            expires, response = next(iter(self._entries.values()))
            if expires > now:
                return
            self.delete(response.id)
