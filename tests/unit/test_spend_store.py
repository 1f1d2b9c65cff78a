"""The job's budget store over Faust tables (dicts standing in): a new store over the
same tables, as after a restart's changelog recovery, has the same spend, reservations
and fired thresholds, summed across tenants for a model's budget."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from stream_jobs.app import TableSpendStore
from stream_jobs.budgets import Budget, Period, due_thresholds, held_in, reserve, settle

AT = datetime(2026, 3, 15, tzinfo=UTC)
MODEL = Budget("model:m|month@UTC", "model:m", 1000, Period.parse("month"))


def store_over(*tables: dict[bytes, bytes]) -> TableSpendStore:
    return TableSpendStore(*(cast(Any, t) for t in tables))


def test_a_restarted_store_resumes_with_the_same_spend() -> None:
    tables: tuple[dict[bytes, bytes], ...] = ({}, {}, {})
    store = store_over(*tables)
    assert reserve(store, [MODEL], "a", "r1", 600, AT).admitted
    assert reserve(store, [MODEL], "b", "r1", 300, AT).admitted
    settle(store, "a", "r1", 500, keep_until=10.0)
    for threshold in due_thresholds(store, MODEL, AT):
        store.fire("a", MODEL.budget_id, "2026-03-01", threshold)

    again = store_over(*tables)
    assert held_in(again, MODEL, AT) == (800, 500)
    assert due_thresholds(again, MODEL, AT) == []  # 50% fired before the restart
    assert reserve(again, [MODEL], "a", "r1", 600, AT).known  # not charged twice
    assert not reserve(again, [MODEL], "c", "r1", 201, AT).admitted
    assert settle(again, "a", "r1", 500, keep_until=10.0) == ()  # a redelivered usage
    again.sweep("a", now=11.0)
    assert again.reservation("a", "r1") is None and again.reservation("b", "r1") is not None
    again.forget()
    assert held_in(again, MODEL, AT) == (800, 500)


class PartitionedTable(dict[bytes, bytes]):
    """A Faust table as one instance sees it: a write lands on the changelog partition
    of the event being handled (requests and usage are keyed by tenant, so the
    tenant's), and an instance holds only its assigned partitions' records."""

    def __init__(self, changelog: dict[int, dict[bytes, bytes]], owned: set[int]) -> None:
        super().__init__({k: v for p in owned for k, v in changelog[p].items()})
        self.changelog = changelog
        self.event_partition = -1

    def __setitem__(self, key: bytes, value: bytes) -> None:
        super().__setitem__(key, value)
        self.changelog[self.event_partition][key] = value

    def pop(self, key: bytes, default: Any = None) -> Any:
        self.changelog[self.event_partition].pop(key, None)
        return super().pop(key, default)


def partition_of(tenant: str) -> int:
    from aiokafka.partitioner import DefaultPartitioner

    return int(DefaultPartitioner()(tenant.encode(), [0, 1], [0, 1]))  # Kafka's, by key


class Instance:
    def __init__(self, changelogs: list[dict[int, dict[bytes, bytes]]], owned: set[int]):
        self.owned = owned
        self.tables = [PartitionedTable(c, owned) for c in changelogs]
        self.store = store_over(*self.tables)

    def handling(self, tenant: str) -> TableSpendStore:
        """The agent of the tenant's partition: only its owner handles the tenant."""
        assert partition_of(tenant) in self.owned
        for table in self.tables:
            table.event_partition = partition_of(tenant)
        return self.store


def test_every_record_of_a_tenant_s_spend_is_keyed_by_that_tenant_first() -> None:
    # The partition rule: what a tenant's request writes is the tenant's (its key starts
    # with the tenant), so it lands on, and is recovered from, the tenant's partition.
    tables: tuple[dict[bytes, bytes], ...] = ({}, {}, {})
    store = store_over(*tables)
    for tenant in ("a", "d"):
        budgets = [
            MODEL,
            Budget(f"tenant:{tenant}|month@UTC", f"tenant:{tenant}", 500, Period("month")),
        ]
        assert reserve(store, budgets, tenant, "r1", 400, AT).admitted
        settle(store, tenant, "r1", 300, keep_until=10.0)
        for budget in budgets:
            for threshold in due_thresholds(store, budget, AT):
                store.fire(tenant, budget.budget_id, "2026-03-01", threshold)
    for table in tables:
        assert {key.decode().split("\t")[0] for key in table} == {"a", "d"}


def test_two_instances_are_exact_for_each_tenant_and_not_for_a_model_budget() -> None:
    assert (partition_of("a"), partition_of("d")) == (0, 1)
    changelogs: list[dict[int, dict[bytes, bytes]]] = [{0: {}, 1: {}} for _ in range(3)]
    one, two = Instance(changelogs, {0}), Instance(changelogs, {1})

    def tenant_budget(tenant: str) -> Budget:
        return Budget(f"tenant:{tenant}|month@UTC", f"tenant:{tenant}", 1000, Period("month"))

    # Each tenant's budget has one owner, which sees all of its spend: exact.
    for n in range(3):
        ok = reserve(one.handling("a"), [tenant_budget("a")], "a", f"r{n}", 400, AT).admitted
        assert ok == (n < 2)  # 400 + 400, then 1200 > 1000: refused
    assert reserve(two.handling("d"), [tenant_budget("d")], "d", "r0", 1000, AT).admitted
    # A model budget across tenants: each instance sums the tenants it holds, so two
    # instances may admit up to the limit each (the README states this limit).
    assert reserve(one.handling("a"), [MODEL], "a", "m1", 1000, AT).admitted
    assert reserve(two.handling("d"), [MODEL], "d", "m1", 1000, AT).admitted
    assert held_in(one.store, MODEL, AT) == held_in(two.store, MODEL, AT) == (1000, 0)
    # A rebalance moves tenant a's partition to the second instance: its changelog comes
    # with it, so the new owner has a's spend and still refuses at the same point.
    moved = Instance(changelogs, {0, 1})
    assert held_in(moved.store, tenant_budget("a"), AT) == (800, 0)
    assert not reserve(moved.handling("a"), [tenant_budget("a")], "a", "r9", 201, AT).admitted
    assert held_in(moved.store, MODEL, AT) == (2000, 0)  # one owner again: the true total
