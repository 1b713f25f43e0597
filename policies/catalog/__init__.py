"""The built-in policies. Importing this package registers every one of them.

To add a policy: write one module here with a `@register_policy` dataclass subclassing
`policies.base.Policy`, and import it below. The conformance tests pick it up from the
registry with no other change.
"""

from policies.catalog import (
    bands,
    deadline,
    est_first,
    fastserve,
    fcfs,
    ltr,
    oracle,
    sagesched,
    ssjf,
    trail,
    vtc,
    wfs,
)

__all__ = [
    "bands",
    "deadline",
    "est_first",
    "fastserve",
    "fcfs",
    "ltr",
    "oracle",
    "sagesched",
    "ssjf",
    "trail",
    "vtc",
    "wfs",
]
