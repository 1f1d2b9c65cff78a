from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from stream_jobs.fair_queue import FairQueue, token_cost


def fill(
    queue: FairQueue[str],
    tenant: str,
    n: int,
    *,
    weight: float = 1.0,
    priority: int = 1,
    num_input: int = 10,
    num_output: int = 10,
) -> None:
    for i in range(n):
        queue.push(
            f"{tenant}-{i}",
            f"{tenant}-{i}",
            tenant=tenant,
            priority=priority,
            weight=weight,
            num_input=num_input,
            num_output=num_output,
        )


def served(queue: FairQueue[str], n: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    for _ in range(n):
        item = queue.pop()
        assert item is not None
        counts[item.split("-")[0]] += 1
    return counts


def test_lower_class_number_is_always_served_first() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "batch", 3, priority=2)
    fill(queue, "std", 3, priority=1)
    fill(queue, "vip", 2, priority=0)
    order = [queue.pop() for _ in range(8)]
    assert order[:2] == ["vip-0", "vip-1"]
    assert all(item is not None and item.startswith("std") for item in order[2:5])
    assert queue.pop() is None


def test_weights_two_to_one_get_service_two_to_one() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "heavy", 300, weight=2.0)
    fill(queue, "light", 300, weight=1.0)
    counts = served(queue, 300)
    assert counts["heavy"] == 200 and counts["light"] == 100


def test_cost_counts_output_twice() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "talker", 100, num_input=10, num_output=40)  # cost 90 each
    fill(queue, "reader", 100, num_input=70, num_output=10)  # cost 90 each
    assert served(queue, 100) == {"talker": 50, "reader": 50}
    assert token_cost(10, 40, 1.0) == token_cost(70, 10, 1.0)


def test_a_tenant_back_from_idle_gets_no_credit() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "busy", 50)
    served(queue, 40)  # "busy" has a large counter now; "idle" has none
    fill(queue, "idle", 50)
    counts = served(queue, 20)
    assert counts["busy"] >= 9, counts  # idle was lifted to busy's counter: they alternate


def test_remove_takes_a_waiting_request_out() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "a", 3)
    assert queue.remove("a-1") == "a-1"
    assert queue.remove("a-1") is None
    assert [queue.pop(), queue.pop(), queue.pop()] == ["a-0", "a-2", None]
    assert len(queue) == 0


def test_correct_replaces_the_output_estimate() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "a", 2, num_input=10, num_output=100)
    queue.pop()
    before = queue.counter("a", 1)
    queue.correct("a", 1, estimated_output=100, actual_output=10)
    assert queue.counter("a", 1) == before - 180


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcdef"), st.sampled_from([1.0, 2.0, 3.0]), min_size=2),
    st.integers(20, 120),
)
def test_backlogged_tenants_share_in_proportion_to_weight(
    weights: dict[str, float], rounds: int
) -> None:
    queue: FairQueue[str] = FairQueue()
    for tenant, weight in weights.items():
        fill(queue, tenant, 1000, weight=weight)
    counts = served(queue, rounds * len(weights))
    # VTC's bound: each tenant's weighted service is within one request of any other's.
    normalised = [counts[t] / w for t, w in weights.items()]
    assert max(normalised) - min(normalised) <= 1.0 + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("xyz"), st.integers(0, 2)), max_size=60))
def test_every_pushed_request_comes_out_once_in_tenant_order(
    pushes: list[tuple[str, int]],
) -> None:
    queue: FairQueue[str] = FairQueue()
    for i, (tenant, priority) in enumerate(pushes):
        queue.push(
            f"{tenant}-{i}",
            f"{tenant}-{i}",
            tenant=tenant,
            priority=priority,
            weight=1.0,
            num_input=5,
            num_output=5,
        )
    out = [queue.pop() for _ in range(len(pushes))]
    assert queue.pop() is None
    assert sorted(x for x in out if x) == sorted(f"{t}-{i}" for i, (t, _) in enumerate(pushes))
    priorities = [pushes[int(x.split("-")[1])][1] for x in out if x]
    assert priorities == sorted(priorities)


def test_peek_shows_what_pop_returns_without_taking_or_charging_it() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "a", 2, priority=2)
    fill(queue, "b", 2, priority=2)
    fill(queue, "v", 1, priority=0)
    assert queue.peek(1) is None
    before = queue.counter("a", 2), queue.counter("b", 2)
    head = queue.peek(2)
    assert head == queue.peek(2)  # twice: nothing moved
    assert (queue.counter("a", 2), queue.counter("b", 2)) == before
    assert len(queue) == 5
    assert queue.pop(0) == "v-0"
    assert queue.pop(2) == head


def test_filler_is_counted_while_it_waits_whichever_way_it_leaves() -> None:
    queue: FairQueue[str] = FairQueue()
    fill(queue, "a", 2)
    for n in range(3):
        queue.push(
            f"b-{n}",
            f"b-{n}",
            tenant="b",
            priority=2,
            weight=1.0,
            num_input=1,
            num_output=1,
            filler=True,
        )
    assert (len(queue), queue.num_filler) == (5, 3)
    assert queue.remove("b-1") == "b-1" and queue.num_filler == 2
    assert queue.remove("b-1") is None and queue.num_filler == 2
    assert [queue.pop() for _ in range(3)] == ["a-0", "a-1", "b-0"]
    assert queue.num_filler == 1
    assert queue.pop() == "b-2" and (len(queue), queue.num_filler) == (0, 0)
