"""Each tenant's limits and what it uses of them: the book the scheduler and the sessions
keep together.

A tenant is who a key speaks for (gateway/api/auth.py names it: a key file's ``name=``,
else ``key-`` and the start of the key's SHA-256; ``""`` on a gateway with no keys). Its
limits come from its line of the key file; a tenant with none has none. What is counted:

- ``max_sessions``: the tenant's sessions (connected or waiting for a resume);
- ``max_running``: its answers in the scheduler (running or queued);
- ``requests_per_minute`` and ``tokens_per_minute`` (output tokens): over the last 60
  seconds, a sliding window. An answer **reserves** tokens when it is admitted (its
  ``max_output_tokens``, else :data:`TOKENS_RESERVED_WITHOUT_LIMIT`; never more than the
  whole limit) and is **settled** when it ends: the reservation goes, the tokens it
  really produced enter the window. Answers started at once cannot overshoot the limit
  (one is admitted only while what the window holds, plus what answers running have
  reserved, plus its own reservation, fits);
- ``weight``: its share of the engine when tenants compete for slots (the scheduler
  admits the waiting tenant with the fewest running answers per weight first).

Over a limit, :meth:`TenantBook.refuse_request` and :meth:`refuse_session` say why and
when to retry; the caller answers OpenAI's ``rate_limit_exceeded`` (HTTP 429 with
``Retry-After``, or the dialect's error event). Everything here runs on the event loop.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

WINDOW_S = 60.0
# What an answer with no max_output_tokens reserves of its tenant's tokens_per_minute
# (docs/deployment.md): most answers are shorter; one that runs longer is charged all it
# produced at its end, so the window stays exact.
TOKENS_RESERVED_WITHOUT_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_sessions: int | None = None
    max_running: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    weight: int = 1


NO_LIMITS = TenantLimits()
LIMIT_NAMES = ("max_sessions", "max_running", "requests_per_minute", "tokens_per_minute")


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """One API key as configured: its SHA-256 (what a request's key is compared with),
    its tenant, the tenant's limits, and the key itself where the configuration holds it
    (a ``sha256:`` line of the key file does not)."""

    digest: bytes
    tenant: str
    limits: TenantLimits = NO_LIMITS
    key: str | None = None


@dataclass(frozen=True, slots=True)
class OverLimit:
    """Why a tenant's request or session is refused, and in how many seconds to retry."""

    message: str
    retry_after: float


@dataclass(slots=True)
class _Usage:
    requests: deque[float] = field(default_factory=deque)  # start times, last minute
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (when, how many)
    token_sum: int = 0


class TenantBook:
    def __init__(
        self,
        limits: Mapping[str, TenantLimits] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits: dict[str, TenantLimits] = dict(limits or {})
        self._clock = clock
        self._usage: dict[str, _Usage] = {}
        self.in_flight: Counter[str] = Counter()  # answers in the scheduler, per tenant
        self.reserved: Counter[str] = Counter()  # their tokens_per_minute reservations
        self.running: Counter[str] = Counter()  # answers in the engine, per tenant
        self.sessions: Counter[str] = Counter()

    def of(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, NO_LIMITS)

    def weight(self, tenant: str) -> int:
        return self.of(tenant).weight

    # -- sessions ----------------------------------------------------------------------

    def refuse_session(self, tenant: str) -> OverLimit | None:
        limit = self.of(tenant).max_sessions
        if limit is not None and self.sessions[tenant] >= limit:
            return OverLimit(f"This key has {limit} sessions open, its max_sessions.", 1.0)
        return None

    def session_opened(self, tenant: str) -> None:
        self.sessions[tenant] += 1

    def session_closed(self, tenant: str) -> None:
        self.sessions[tenant] -= 1
        if self.sessions[tenant] <= 0:
            del self.sessions[tenant]

    # -- answers -----------------------------------------------------------------------

    def reservation(self, tenant: str, max_output_tokens: int | None) -> int:
        """The tokens an answer of ``tenant`` limited to ``max_output_tokens`` reserves
        (0 for a tenant without ``tokens_per_minute``)."""
        tpm = self.of(tenant).tokens_per_minute
        if tpm is None:
            return 0
        wanted = TOKENS_RESERVED_WITHOUT_LIMIT if max_output_tokens is None else max_output_tokens
        return max(0, min(wanted, tpm))

    def refuse_request(
        self, tenant: str, answers: int = 1, max_output_tokens: int | None = None
    ) -> OverLimit | None:
        """Whether ``tenant`` may start ``answers`` more answers (each limited to
        ``max_output_tokens``) now, and if not, why: each choice of a request with several
        is an answer, and reserves its own tokens."""
        limits = self.of(tenant)
        if limits is NO_LIMITS:
            return None
        running = limits.max_running
        if running is not None and self.in_flight[tenant] + answers > running:
            return OverLimit(f"This key has {running} answers running, its max_running.", 1.0)
        usage = self._window(tenant)
        now = self._clock()
        rpm = limits.requests_per_minute
        if rpm is not None and len(usage.requests) + answers > rpm:
            wait = usage.requests[0] + WINDOW_S - now if usage.requests else WINDOW_S
            return OverLimit(f"This key's requests_per_minute ({rpm}) is used up.", wait)
        tpm = limits.tokens_per_minute
        wanted = self.reservation(tenant, max_output_tokens)
        need = answers * max(wanted, 1)
        if tpm is not None and usage.token_sum + self.reserved[tenant] + need > tpm:
            # Room comes back as the window's oldest tokens leave it, or (when answers
            # running hold it) as they end.
            wait = usage.tokens[0][0] + WINDOW_S - now if usage.tokens else 1.0
            return OverLimit(f"This key's tokens_per_minute ({tpm}) is used up.", wait)
        return None

    def request_started(self, tenant: str, max_output_tokens: int | None = None) -> int:
        """An answer of ``tenant`` is admitted; returns the tokens it reserves (give them
        back to :meth:`request_ended`)."""
        self.in_flight[tenant] += 1
        if self.of(tenant).requests_per_minute is not None:
            self._window(tenant).requests.append(self._clock())
        reserved = self.reservation(tenant, max_output_tokens)
        if reserved:
            self.reserved[tenant] += reserved
        return reserved

    def request_ended(self, tenant: str, output_tokens: int, reserved: int = 0) -> None:
        """Settle an answer: its reservation goes, the tokens it produced are charged."""
        self.in_flight[tenant] -= 1
        if self.in_flight[tenant] <= 0:
            del self.in_flight[tenant]
        if reserved:
            self.reserved[tenant] -= reserved
            if self.reserved[tenant] <= 0:
                del self.reserved[tenant]
        if output_tokens and self.of(tenant).tokens_per_minute is not None:
            usage = self._window(tenant)
            usage.tokens.append((self._clock(), output_tokens))
            usage.token_sum += output_tokens

    def remaining(self, tenant: str) -> list[dict[str, object]]:
        """The tenant's limits as Realtime's ``rate_limits.updated`` names them (those it
        has): ``requests`` and ``tokens``, each with ``limit``, ``remaining`` and
        ``reset_seconds``."""
        limits = self.of(tenant)
        if limits.requests_per_minute is None and limits.tokens_per_minute is None:
            return []
        usage = self._window(tenant)
        now = self._clock()
        out: list[dict[str, object]] = []
        if limits.requests_per_minute is not None:
            reset = usage.requests[0] + WINDOW_S - now if usage.requests else 0.0
            out.append(
                {
                    "name": "requests",
                    "limit": limits.requests_per_minute,
                    "remaining": max(0, limits.requests_per_minute - len(usage.requests)),
                    "reset_seconds": round(max(0.0, reset), 3),
                }
            )
        if limits.tokens_per_minute is not None:
            reset = usage.tokens[0][0] + WINDOW_S - now if usage.tokens else 0.0
            out.append(
                {
                    "name": "tokens",
                    "limit": limits.tokens_per_minute,
                    "remaining": max(
                        0, limits.tokens_per_minute - usage.token_sum - self.reserved[tenant]
                    ),
                    "reset_seconds": round(max(0.0, reset), 3),
                }
            )
        return out

    def _window(self, tenant: str) -> _Usage:
        usage = self._usage.setdefault(tenant, _Usage())
        horizon = self._clock() - WINDOW_S
        while usage.requests and usage.requests[0] <= horizon:
            usage.requests.popleft()
        while usage.tokens and usage.tokens[0][0] <= horizon:
            usage.token_sum -= usage.tokens.popleft()[1]
        return usage


def retry_after_header(seconds: float) -> str:
    """``Retry-After``'s value: whole seconds, at least one."""
    return str(max(1, math.ceil(seconds)))
