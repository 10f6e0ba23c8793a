"""The one check every configuration class runs: `require(condition, field, message)`."""

from __future__ import annotations


def require(cond: bool, name: str, msg: str) -> None:
    """Raise `ValueError("<name>: <msg>")` unless `cond`: the field's name comes first, so the API
    can answer 400 naming it."""
    if not cond:
        raise ValueError(f"{name}: {msg}")
