"""Config-building helpers shared by extractors and rules (config arrives as JSON or YAML)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TypeVar

from .budget import Pattern, error

_C = TypeVar("_C", bound=type)


def check_number(
    owner: str, name: str, value: object, lo: float, hi: float, *, integer: bool = False
) -> None:
    # Config arrives as JSON/YAML: a "2000" string or a bool must fail here, not deep inside a
    # transform.
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{owner}: {name} must be {kind} in [{lo}, {hi}], got {value!r}")


def compile_pattern(owner: str, pattern: object, flags: int = 0) -> Pattern:
    # Budgeted: a user's pattern may come from the network and backtrack for ever on a crafted step.
    if not isinstance(pattern, str):
        raise ValueError(f"{owner}: pattern must be a string, got {pattern!r}")
    try:
        return Pattern(pattern, flags)
    except (error, ValueError, OverflowError) as e:
        raise ValueError(f"{owner}: invalid regular expression {pattern!r}: {e}") from None


def known(registry: Mapping[str, object]) -> str:
    return ", ".join(sorted(registry))


def instantiate(
    kind: str, name: str, factory: Callable[..., Any], params: Mapping[str, Any]
) -> Any:
    """Call `factory(**params)`, turning unknown, missing or invalid parameters into a ValueError
    that says which."""
    try:
        accepted = [
            p for p in inspect.signature(factory).parameters.values() if not p.name.startswith("_")
        ]
    except (TypeError, ValueError):  # builtins without a signature: let the call speak for itself
        accepted = []
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted)
    names = [p.name for p in accepted if p.kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = sorted(k for k in params if k not in names)
    if unknown and accepted and not takes_any:
        raise ValueError(
            f"{kind} {name!r} does not take {', '.join(map(repr, unknown))}; "
            f"its parameters are: {', '.join(names) or '(none)'}"
        )
    try:
        return factory(**params)
    except TypeError as e:
        raise ValueError(f"{kind} {name!r}: bad parameters {dict(params)!r}: {e}") from None


def registrar(registry: MutableMapping[str, Any], kind: str, key: str) -> Callable[[_C], _C]:
    """A class decorator adding the class to `registry` under `key`; another class under a taken
    key is an error."""
    if not key or not isinstance(key, str):
        raise ValueError(f"{kind} name must be a non-empty string, got {key!r}")

    def add(cls: _C) -> _C:
        taken = registry.get(key)
        if taken is not None and taken is not cls:
            raise ValueError(
                f"{kind} name {key!r} is already taken by {taken.__qualname__}; pick another name"
            )
        registry[key] = cls
        return cls

    return add
