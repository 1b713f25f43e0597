"""The router registry: stable names to router classes, loud on duplicates.

Every router module registers its class with `@register_router`. The CLI (`sagesched
routers`), tests and studies iterate this registry. Specs look like policies' specs:
`name` or `name:param=value,param=value` (`random:seed=3`, `prefix:prefix_weight=2`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

from policies.registry import coerce_param
from policies.routing.base import Router

R = TypeVar("R", bound=type[Router])

_ROUTERS: dict[str, type[Router]] = {}


def register_router(cls: R) -> R:
    """Class decorator: add a router class under its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _ROUTERS:
        raise ValueError(f"router name {cls.name!r} registered twice")
    if not cls.description:
        raise ValueError(f"router {cls.name!r} has no description")
    _ROUTERS[cls.name] = cls
    return cls


def _load_catalog() -> None:
    import policies.routing.catalog  # noqa: F401  (registers the built-in routers)


def router_names() -> list[str]:
    """All registered names, sorted."""
    _load_catalog()
    return sorted(_ROUTERS)


def router_class(name: str) -> type[Router]:
    """The class registered under `name`; unknown names list the known ones."""
    _load_catalog()
    try:
        return _ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(sorted(_ROUTERS))}") from None


def make_router(name: str, **params: Any) -> Router:
    """Instantiate a router; unknown parameters are errors."""
    cls = router_class(name)
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(
            f"router {name!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(allowed)}"
        )
    return cls(**params)


def parse_router(spec: str) -> Router:
    """Build a router from `name[:key=value,...]`, coercing values to the declared types."""
    name, _, rest = spec.strip().partition(":")
    cls = router_class(name)
    hints = typing.get_type_hints(cls)
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"router parameter {item!r} must look like key=value")
        params[key] = coerce_param(raw, hints.get(key, str), f"{name}.{key}")
    return make_router(name, **params)


@dataclass(frozen=True, slots=True)
class RouterInfo:
    """One catalog row: name, description, whether it reads prefixes, and its parameters."""

    name: str
    description: str
    uses_prefix: bool
    params: tuple[tuple[str, Any, str], ...]


def router_catalog() -> list[RouterInfo]:
    """Every registered router, sorted by name."""
    rows = []
    for name in router_names():
        cls = _ROUTERS[name]
        params = tuple(
            (f.name, f.default, str(f.metadata.get("help", "")))
            for f in dataclasses.fields(cls)
            if f.init and not f.metadata.get("engine")
        )
        rows.append(RouterInfo(name, cls.description, cls.uses_prefix, params))
    return rows
