"""The model catalog: which models the fleet serves now, from heartbeats, and which
models exist. Pure: the caller passes the clock.

The configured ``served_model_name`` always counts as served, so ``/v1/models`` answers
the same before the first heartbeat has arrived as after. A model exists if it is served
now or configured (``bridge_models``); any other name is a 404 ``model_not_found``. A
model that exists may still have no live worker: the job refuses that request (503
``no_worker``), since a worker that just started may serve it before its first heartbeat
reaches this bridge.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas import WorkerStatus
from tokenbus.tenants import TenantConfig, split_model


class ServedModels:
    def __init__(
        self, default: str, *, dead_after_s: float, configured: Iterable[str] = ()
    ) -> None:
        self._default = default
        self._dead_after_s = dead_after_s
        self._configured = frozenset(configured)
        self._seen: dict[str, tuple[str, float]] = {}  # worker_id -> (model, seen at)

    def observe(self, status: WorkerStatus, now: float) -> None:
        self._seen[status.worker_id] = (status.model, now)

    def names(self, now: float) -> list[str]:
        live = {model for model, seen in self._seen.values() if now - seen < self._dead_after_s}
        return sorted(live | {self._default})

    def knows(self, model: str, now: float) -> bool:
        """``base:adapter`` exists when its base does (access to the adapter is checked
        before: a caller learns nothing of adapters it may not use)."""
        base, _ = split_model(model)
        return base in self._configured or base in self.names(now)

    def names_for(self, tenant: TenantConfig, now: float) -> list[str]:
        """What ``/v1/models`` lists to a tenant: the served models it may use, and
        ``base:adapter`` for each adapter it may use on one of them."""
        bases = [name for name in self.names(now) if tenant.may_use(name)]
        adapters = [
            f"{adapter.base_model}:{name}"
            for name, adapter in tenant.adapters.items()
            if adapter.base_model in self.names(now)
            and tenant.may_use(f"{adapter.base_model}:{name}")
        ]
        return sorted(bases) + sorted(adapters)
