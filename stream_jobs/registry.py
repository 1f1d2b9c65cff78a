"""Live workers, from their heartbeats: who serves what, and who has died.

Pure: the caller passes the clock. A worker run (an *incarnation*) is live while its
last heartbeat is younger than ``dead_after_s``. It is gone when it stays silent that
long, or at once when the same worker id reports a new incarnation (it restarted).
``reap`` hands each gone run out once, so the dispatcher can send its requests
elsewhere (telling the run to drop them, in case it was only presumed dead). A run
that heartbeats again after that is live again, for new work.

Silence is measured on the caller's own time: when the caller itself was stalled (its
event loop blocked, so heartbeats waited unread), ``reap`` is called late, and the
stall is not held against the workers. Silence is also measured against the other
workers: a run that has been silent for ``dead_after_s`` of heartbeats the caller did
read from others is gone, however late ``reap`` is called. (A job whose loop lagged
by half a second at every turn, under load, otherwise never declared a dead worker.)

The live set is kept between changes: the dispatch loop asks for it (and the fleet's
seats) at every pick, and it only changes with a heartbeat, a reap, or the moment the
stalest live view's silence reaches ``dead_after_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import WorkerStatus
from stream_jobs.routing import Candidate

ADAPTER_SENT_HOLD_S = 5.0
"""How long an adapter sent to a worker counts as held without a heartbeat saying so:
the worker loads it when the request arrives, which may be after a heartbeat or two."""


@dataclass
class WorkerView:
    status: WorkerStatus
    seen_at: float
    """When its last heartbeat was read, moved on by the caller's stalls."""
    num_unseen_dispatches: int = 0
    heard_at: float = 0.0
    """When its last heartbeat was read, as read."""
    sent_adapters: dict[str, float] = field(default_factory=dict)
    """LoRA adapters dispatched to it, and when: held as far as routing goes until a
    heartbeat lists them (or ``ADAPTER_SENT_HOLD_S`` passes)."""
    _candidate: Candidate | None = field(default=None, init=False, repr=False, compare=False)
    """``candidate()`` as last made: a heartbeat makes a new view, and ``note_dispatch``
    (the one change to a view after that) drops it. Every pick reads every live worker
    of its model, and making a ``Candidate`` was most of a pick's CPU at 64 workers."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.status.worker_id, self.status.incarnation)

    @property
    def load(self) -> float:
        queued = self.status.num_running + self.status.num_waiting + self.num_unseen_dispatches
        return queued / max(1, self.status.max_num_seqs)

    def candidate(self) -> Candidate:
        if self._candidate is not None:
            return self._candidate
        self._candidate = Candidate(
            worker_id=self.status.worker_id,
            capacity=self.status.max_num_seqs,
            num_running=self.status.num_running,
            num_waiting=self.status.num_waiting,
            num_unseen=self.num_unseen_dispatches,
            kv_usage=self.status.kv_cache_usage,
            max_loras=self.status.max_loras,
            adapters=frozenset(self.status.adapters).union(self.sent_adapters),
        )
        return self._candidate

    def note_dispatch(self, adapter: str | None, now: float) -> None:
        """A request sent to it since its last heartbeat (with ``adapter``, if any)."""
        self.num_unseen_dispatches += 1
        if adapter is not None and adapter not in self.status.adapters:
            self.sent_adapters[adapter] = now
        self._candidate = None


@dataclass
class _Live:
    views: list[WorkerView]
    since: float
    stalest: float | None
    """The oldest ``seen_at`` of the views: the first to fall silent."""
    capacity: int
    by_model: dict[str, list[WorkerView]] = field(default_factory=dict)

    def holds_at(self, now: float, dead_after_s: float) -> bool:
        """Whether the same views are live at ``now``: later than when they were worked
        out (a view dead then stays dead) and before the stalest falls silent (by the
        very test ``all_live`` makes)."""
        return self.since <= now and (self.stalest is None or now - self.stalest < dead_after_s)


@dataclass
class WorkerRegistry:
    dead_after_s: float = 3.0
    _workers: dict[str, WorkerView] = field(default_factory=dict)
    stall_s: float = 0.5
    """A gap this long between two ``reap`` calls is the caller's stall, not silence."""
    _gone: list[tuple[str, str]] = field(default_factory=list)
    _superseded: set[tuple[str, str]] = field(default_factory=set)
    _reaped_at: float | None = None
    _live: _Live | None = None
    """The live views as last worked out, and the span of time they hold for."""

    def observe(self, status: WorkerStatus, now: float) -> None:
        key = (status.worker_id, status.incarnation)
        if key in self._superseded:
            return  # a late heartbeat of a run its worker has since replaced
        previous = self._workers.get(status.worker_id)
        if previous is not None and previous.key != key:
            self._superseded.add(previous.key)
            self._retire(previous)
        self._live = None
        # Requests dispatched since the previous heartbeat may not be in its counts yet;
        # the new heartbeat is the best count there is, so the tally starts again.
        held: dict[str, float] = {}
        if previous is not None and previous.key == key:
            # An adapter just sent may not be loaded yet: it stays held for a while.
            held = {
                name: at
                for name, at in previous.sent_adapters.items()
                if name not in status.adapters and now - at < ADAPTER_SENT_HOLD_S
            }
        self._workers[status.worker_id] = WorkerView(
            status=status, seen_at=now, heard_at=now, sent_adapters=held
        )

    def reap(self, now: float) -> list[tuple[str, str]]:
        """Runs gone since the last call, as (worker_id, incarnation), each once."""
        if self._reaped_at is not None and now - self._reaped_at >= self.stall_s:
            for view in self._workers.values():
                view.seen_at += now - self._reaped_at
            self._live = None
        self._reaped_at = now
        freshest = max((view.heard_at for view in self._workers.values()), default=now)
        for view in list(self._workers.values()):
            if (
                now - view.seen_at >= self.dead_after_s
                or freshest - view.heard_at >= self.dead_after_s
            ):
                self._retire(view)
        gone, self._gone = self._gone, []
        return gone

    def _retire(self, view: WorkerView) -> None:
        self._live = None
        self._gone.append(view.key)
        if self._workers.get(view.status.worker_id) is view:
            del self._workers[view.status.worker_id]

    def all_live(self, now: float) -> list[WorkerView]:
        """Not draining, and heard from within ``dead_after_s``. The list is shared
        until the live set changes: read it, do not change it."""
        return self._live_at(now).views

    def live(self, model: str, now: float) -> list[WorkerView]:
        live = self._live_at(now)
        views = live.by_model.get(model)
        if views is None:
            views = live.by_model[model] = [v for v in live.views if v.status.model == model]
        return views

    def capacity(self, now: float) -> int:
        """The live fleet's seats: the sum of its ``max_num_seqs``."""
        return self._live_at(now).capacity

    def _live_at(self, now: float) -> _Live:
        live = self._live
        if live is None or not live.holds_at(now, self.dead_after_s):
            views = [
                view
                for view in self._workers.values()
                if not view.status.draining and now - view.seen_at < self.dead_after_s
            ]
            live = self._live = _Live(
                views,
                since=now,
                stalest=min((view.seen_at for view in views), default=None),
                capacity=sum(view.status.max_num_seqs for view in views),
            )
        return live

    def get(self, worker_id: str) -> WorkerView | None:
        return self._workers.get(worker_id)

    def note_dispatch(self, worker_id: str, adapter: str | None = None, now: float = 0.0) -> None:
        view = self._workers.get(worker_id)
        if view is not None:
            view.note_dispatch(adapter, now)

    def models(self, now: float) -> set[str]:
        return {view.status.model for view in self.all_live(now)}
