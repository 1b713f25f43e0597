"""Pure scheduling logic: the job model, length and cost distributions, the Gittins index,
the policy contract and catalog, and the queue.

Dependency rule: this package imports only the standard library and numpy. It knows nothing
of asyncio, HTTP or clocks: time is a number the caller passes in, so the same policy object
orders the live gateway's queue and the simulator's. To add a policy, see
`policies.catalog`. Where a job goes (the routers, their prefix index) lives in
`policies.routing`, under the same rule.
"""

from policies.base import Key, Policy
from policies.cost import (
    COST_MODELS,
    CostModel,
    KVCost,
    LatencyProfile,
    LinearProfile,
    TimeCost,
    TokensCost,
    attained_cost,
    make_cost_model,
)
from policies.dist import LengthDist
from policies.gittins import gittins_index, gittins_index_and_horizon
from policies.job import Job
from policies.queue import PolicyQueue
from policies.registry import (
    PolicyInfo,
    catalog,
    make_policy,
    parse_policy,
    policy_class,
    policy_names,
    register_policy,
)
from policies.scheduler import Scheduler

__all__ = [
    "COST_MODELS",
    "CostModel",
    "Job",
    "KVCost",
    "Key",
    "LatencyProfile",
    "LengthDist",
    "LinearProfile",
    "Policy",
    "PolicyInfo",
    "PolicyQueue",
    "Scheduler",
    "TimeCost",
    "TokensCost",
    "attained_cost",
    "catalog",
    "gittins_index",
    "gittins_index_and_horizon",
    "make_cost_model",
    "make_policy",
    "parse_policy",
    "policy_class",
    "policy_names",
    "register_policy",
]
