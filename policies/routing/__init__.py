"""Routing: which backend a job goes to. Pure like the policies (stdlib only, no clock, no
I/O), so the same router object routes in the gateway and in the simulator.

`base.py` is the contract (`Router`, the `BackendState` record an engine fills per decision),
`prefix_index.py` the per-backend LRU index of prompt blocks sent, `registry.py` the names
(`sagesched routers`), `catalog/` one module per router. To add a router, see
`policies.routing.catalog`.
"""

from policies.routing.base import (
    REASONS,
    BackendState,
    PrefixLookup,
    PrefixRouter,
    Router,
)
from policies.routing.prefix_index import PrefixIndex, PrefixIndexes
from policies.routing.registry import (
    RouterInfo,
    make_router,
    parse_router,
    register_router,
    router_catalog,
    router_class,
    router_names,
)

__all__ = [
    "REASONS",
    "BackendState",
    "PrefixIndex",
    "PrefixIndexes",
    "PrefixLookup",
    "PrefixRouter",
    "Router",
    "RouterInfo",
    "make_router",
    "parse_router",
    "register_router",
    "router_catalog",
    "router_class",
    "router_names",
]
