"""The built-in routers. Importing this package registers every one of them.

To add a router: write one module here with a `@register_router` dataclass subclassing
`policies.routing.base.Router` (or `PrefixRouter` to keep an index of what was sent where),
and import it below. The conformance tests pick it up from the registry.
"""

from policies.routing.catalog import (
    cache_aware,
    least_loaded,
    prefix,
    random_choice,
    round_robin,
    sagesched,
    session,
)

__all__ = [
    "cache_aware",
    "least_loaded",
    "prefix",
    "random_choice",
    "round_robin",
    "sagesched",
    "session",
]
