"""The policy registry: stable names to policy classes.

Every policy module registers its class with `@register_policy`; a second registration of a
name is an error. The CLI, YAML config, tests and studies all iterate this registry, never a
hand-written list. Specs look like `name` or `name:param=value,param=value`; a parameter of
(key, value) pairs is written `key:value;key:value` (`bands:band_shares=2:0.1`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from policies.base import Policy

P = TypeVar("P", bound=type[Policy])

_POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: P) -> P:
    """Class decorator: add a policy class under its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _POLICIES:
        raise ValueError(f"policy name {cls.name!r} registered twice")
    if not cls.description:
        raise ValueError(f"policy {cls.name!r} has no description")
    _POLICIES[cls.name] = cls
    return cls


def _load_catalog() -> None:
    import policies.catalog  # noqa: F401  (registers the built-in policies)


def policy_names() -> list[str]:
    """All registered names, sorted."""
    _load_catalog()
    return sorted(_POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The class registered under `name`; unknown names list the known ones."""
    _load_catalog()
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join(sorted(_POLICIES))}"
        ) from None


def make_policy(name: str, **params: Any) -> Policy:
    """Instantiate a policy; unknown parameters are errors."""
    cls = policy_class(name)
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(
            f"policy {name!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(allowed)}"
        )
    return cls(**params)


def parse_policy(spec: str) -> Policy:
    """Build a policy from `name[:key=value,...]`, coercing values to the declared types."""
    name, _, rest = spec.strip().partition(":")
    cls = policy_class(name)
    hints = typing.get_type_hints(cls)
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"policy parameter {item!r} must look like key=value")
        params[key] = coerce_param(raw, hints.get(key, str), f"{name}.{key}")
    return make_policy(name, **params)


def coerce_param(raw: str, hint: Any, where: str) -> Any:
    """`raw` text read as a parameter of type `hint` (int, float, str, bool, optional, or
    (key, value) pairs written `k:v;k:v`); `where` names it in errors. Routers share it."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        if type(None) in args and raw.lower() == "none":
            return None
        hint = next(a for a in args if a is not type(None))  # text: the first type
    pair = _pair_types(hint)
    if pair is not None:  # (key, value) pairs, written `k:v;k:v` (e.g. band_shares=2:0.1)
        items = [item.partition(":") for item in filter(None, raw.split(";"))]
        if any(not sep for _, sep, _ in items):
            raise ValueError(f"{where}: write pairs as key:value;key:value, not {raw!r}")
        return tuple(
            (coerce_param(k, pair[0], where), coerce_param(v, pair[1], where)) for k, _, v in items
        )
    try:
        if hint is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if hint in (int, float, str):
            return hint(raw)
    except ValueError:
        raise ValueError(f"{where}: cannot read {raw!r} as {hint.__name__}") from None
    raise ValueError(f"{where}: parameters of type {hint} cannot be set from text")


def _pair_types(hint: Any) -> tuple[Any, Any] | None:
    """(K, V) if `hint` is `tuple[tuple[K, V], ...]`, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is not tuple or len(args) != 2 or args[1] is not Ellipsis:
        return None
    inner = typing.get_args(args[0])
    if typing.get_origin(args[0]) is not tuple or len(inner) != 2:
        return None
    return inner[0], inner[1]


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """One catalog row: name, description, and parameters with defaults and help."""

    name: str
    description: str
    preemptive: str
    needs: str
    params: tuple[tuple[str, Any, str], ...]


def catalog() -> list[PolicyInfo]:
    """Every registered policy, sorted by name."""
    rows = []
    for name in policy_names():
        cls = _POLICIES[name]
        default = cls()
        params = tuple(
            (f.name, f.default, str(f.metadata.get("help", "")))
            for f in dataclasses.fields(cls)
            if f.init and not f.metadata.get("engine")
        )
        needs = "oracle" if cls.needs_oracle else "prediction" if cls.needs_prediction else "-"
        preempt = "yes" if default.preemptive else "no"
        rows.append(PolicyInfo(name, cls.description, preempt, needs, params))
    return rows
