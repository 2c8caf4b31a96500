"""Refusing bad input: one way to say what was wrong, used by every module.

Introduced in chapter 3. Every refusal names the argument, what was expected and what
was given (`argument: expected X, got Y`), and is raised before anything changes.
"""

from __future__ import annotations

from typing import NoReturn


def fail(argument: str, expected: str, got: object, error: type[Exception] = ValueError) -> NoReturn:
    """Raise `error` (ValueError unless told) with the message `argument: expected X, got Y`."""
    raise error(f"{argument}: expected {expected}, got {got}")


def is_int(x: object) -> bool:
    """True for a Python int that is not a bool (bools are ints, but never a count or a size)."""
    return isinstance(x, int) and not isinstance(x, bool)
