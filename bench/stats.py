"""Percentiles and the per-run summary every scenario reports."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def dist(values: Iterable[float], scale: float = 1000.0) -> dict[str, float]:
    """p50/p90/p99/max and the count, scaled (seconds to milliseconds by default)."""
    ordered = sorted(values)
    out = {f"p{q}": percentile(ordered, q) * scale for q in (50, 90, 99)}
    out["max"] = ordered[-1] * scale if ordered else math.nan
    out["n"] = float(len(ordered))
    return out


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: numbers rounded, NaN and None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def ratio(a: float | None, b: float | None) -> float:
    """``a / b``, NaN when either is missing or ``b`` is zero."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b
