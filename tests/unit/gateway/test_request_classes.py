"""Request classes: config validation, resolution (header, key, default), the composed policy,
admission bounds and the shedding order, and bounded tenant labels."""

from __future__ import annotations

import pytest

from gateway.config import ClassesSettings, ConfigError, TrafficClass, as_dict, build
from gateway.errors import QueueFull, Shed, UnknownClass
from gateway.observability.metrics import TenantLabels
from gateway.scheduling.classes import Admission, Classes
from policies import Job, parse_policy
from policies.catalog.bands import Bands

SETTINGS = ClassesSettings(
    default="standard",
    list=(
        TrafficClass("interactive", priority=0, max_waiting=2, api_keys=("k-int",)),
        TrafficClass("standard", priority=1),
        TrafficClass("batch", priority=2, share=0.1, sheddable=True, api_keys=("k-batch",)),
        TrafficClass("bulk", priority=2, share=0.1),
    ),
)


def test_default_classes_are_documented_defaults() -> None:
    cfg = build({"backends": [{"url": "http://b:1"}]})
    names = [(c.name, c.priority, c.sheddable) for c in cfg.classes.list]
    assert names == [("interactive", 0, False), ("standard", 1, False), ("batch", 2, True)]
    assert cfg.classes.default == "standard"


@pytest.mark.parametrize(
    ("classes", "match"),
    [
        ({"list": [{"name": "a"}, {"name": "a"}], "default": "a"}, "unique"),
        ({"list": [{"name": "a"}], "default": "b"}, "default"),
        ({"list": [{"name": "a", "share": 1.0}], "default": "a"}, "share"),
        (
            {
                "list": [{"name": "a", "priority": 2, "share": 0.1}, {"name": "b", "priority": 2}],
                "default": "a",
            },
            "one per priority",
        ),
        ({"list": [{"name": "a", "max_waiting": 0}], "default": "a"}, "> 0"),
        ({"list": [{"name": "a", "slo_target": 1.0}], "default": "a"}, "slo_target"),
        (
            {
                "list": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}],
                "default": "a",
            },
            "one class",
        ),
        ({"list": [{"name": "a", "colour": "red"}], "default": "a"}, "unknown key"),
    ],
)
def test_bad_class_config_names_the_problem(classes: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build({"backends": [{"url": "http://b:1"}], "classes": classes})


def test_class_keys_are_masked_in_the_logged_config() -> None:
    classes = {"list": [{"name": "a", "api_keys": ["secret"]}], "default": "a"}
    cfg = build({"backends": [{"url": "http://b:1"}], "classes": classes})
    assert "secret" not in repr(as_dict(cfg))


def test_resolution_by_header_key_and_default() -> None:
    c = Classes(SETTINGS)
    assert c.resolve(None, None).name == "standard"
    assert c.resolve(" batch ", None).name == "batch"
    assert c.resolve(None, "k-int").name == "interactive"
    assert c.resolve("batch", "k-int").name == "batch"  # a key may ask for less
    assert c.resolve("interactive", "k-batch").name == "batch"  # never for more
    with pytest.raises(UnknownClass) as err:
        c.resolve("gold", None)
    assert err.value.status == 400
    assert all(n in err.value.message for n in ("interactive", "standard", "batch", "bulk"))
    off = Classes(ClassesSettings(header=False, list=SETTINGS.list))
    assert off.resolve("interactive", None).name == "standard"  # header ignored


def test_compose_wraps_the_policy_with_the_bands_shares() -> None:
    policy = Classes(SETTINGS).compose(parse_policy("sagesched:cost=tokens,preempt_rule=index"))
    assert isinstance(policy, Bands)
    assert policy.band_shares == ((2, 0.1),)
    assert policy.inner_policy.label() == "sagesched:cost=tokens,preempt_rule=index"
    explicit = parse_policy("bands:inner=fcfs")
    assert Classes(SETTINGS).compose(explicit) is explicit


def test_compose_keeps_parameters_a_nested_spec_cannot_carry() -> None:
    policy = Classes(SETTINGS).compose(parse_policy("vtc:tenant_weights=a:2;b:1"))
    assert isinstance(policy, Bands)
    assert policy.inner_policy.params()["tenant_weights"] == (("a", 2.0), ("b", 1.0))
    assert policy.fresh().inner_policy.params() == policy.inner_policy.params()


class Queue:
    """Admission over a counted queue (the dispatcher's `waiting()`)."""

    def __init__(self, bound: int) -> None:
        self.classes = Classes(SETTINGS)
        self.n = 0
        self.admission = Admission(self.classes, bound, 7, lambda: self.n)
        self.ids = iter(range(10**6))
        self.klass_of: dict[int, TrafficClass] = {}

    def add(self, klass: str) -> tuple[Job, Job | None]:
        job = Job(id=next(self.ids), arrival_s=float(self.n), prompt_tokens=1)
        victim = self.admission.admit(job, self.classes.by_name[klass])
        if victim is None:
            self.n += 1
        else:
            self.admission.left(victim, self.klass_of[victim.id])
        self.klass_of[job.id] = self.classes.by_name[klass]
        return job, victim


def test_shedding_order() -> None:
    q = Queue(bound=4)
    bulk, _ = q.add("bulk")
    batch, _ = q.add("batch")
    q.add("standard")
    q.add("interactive")
    with pytest.raises(Shed) as shed:  # full: a sheddable arrival is refused first
        q.add("batch")
    assert shed.value.status == 429 and shed.value.headers() == {"Retry-After": "7"}
    assert q.add("standard")[1] is batch  # the sheddable one goes first, though bulk is older
    assert q.add("interactive")[1] is bulk  # then the lowest band's oldest
    with pytest.raises(QueueFull) as full:  # interactive at its own bound of 2
        q.add("interactive")
    assert not isinstance(full.value, Shed)
    with pytest.raises(QueueFull):  # nothing less urgent than standard waits any more
        q.add("standard")


def test_nothing_less_urgent_means_queue_full() -> None:
    q = Queue(bound=2)
    q.add("standard")
    q.add("standard")
    with pytest.raises(QueueFull):
        q.add("standard")
    assert q.add("interactive")[1] is not None  # interactive evicts a standard one


def test_tenant_labels_are_hashed_and_bounded() -> None:
    labels = TenantLabels(top=2)
    for _ in range(5):
        heavy = labels.label("heavy")
    assert heavy.startswith("t-") and "heavy" not in heavy
    seen = {labels.label(f"user-{i}") for i in range(1000)}
    assert "other" in seen and len(seen - {"other"}) <= 8  # at most 4 x top labels ever
    assert labels.label("heavy") == heavy  # still among the busiest
    assert TenantLabels(top=0).label("x") == "other"
