"""The bridge's metrics (bridge.metrics) and where the gateway records them: a stream's
outcome and its mean inter-token latency, once at its end; tenants bounded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bridge.feed import ChunkFeed
from bridge.gateway import Gateway
from bridge.metrics import BridgeMetrics
from bridge.relay import DONE, Relay
from schemas import FinishReason
from tokenbus.chunks import Chunk, ChunkError
from tokenbus.config import Settings
from tokenbus.metrics import OTHER, TenantLabels


def _samples(metrics: BridgeMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


class Feed(ChunkFeed):
    """The chunks given, without ``ChunkFeed``'s drain task."""

    def __init__(self, chunks: list[Chunk]) -> None:
        self._chunks = chunks
        self.closed = False

    async def get(self, timeout_s: float | None) -> Chunk | None:
        return self._chunks.pop(0)

    def close(self) -> None:
        self.closed = True


def _gateway(metrics: BridgeMetrics) -> Gateway:
    none: Any = None
    return Gateway(Settings(), none, none, none, none, none, metrics, none)


def chunk(seq: int, n: int, finish: FinishReason | None = None, **kw: Any) -> Chunk:
    return Chunk("r1", "acme", seq, text="x" * n, num_tokens=n, finish_reason=finish, **kw)


async def _stream(metrics: BridgeMetrics, chunks: list[Chunk]) -> list[bytes]:
    labels = metrics.labels("acme", "tiny-llama", 1)
    caller = SimpleNamespace(tenant=SimpleNamespace(tpm=1000))
    request: Any = SimpleNamespace(request_id="r1")
    events = _gateway(metrics)._events(
        Feed(chunks[1:]),
        Relay("text", "r1", "tiny-llama", 3),
        request,
        chunks[0],
        False,
        caller,  # type: ignore[arg-type]
        labels=labels,
    )
    return [event async for event in events]


LABELS = frozenset({("tenant", "acme"), ("model", "tiny-llama"), ("priority", "1")})


async def test_a_stream_counts_ok_and_observes_its_mean_gap_once() -> None:
    metrics = BridgeMetrics()
    events = await _stream(
        metrics, [chunk(0, 1), chunk(1, 2), chunk(2, 3), chunk(3, 1, FinishReason.STOP)]
    )

    assert events[-1] == DONE
    got = _samples(metrics)
    assert got[("tokenbus_bridge_completions_total", LABELS | {("code", "ok")})] == 1
    assert got[("tokenbus_bridge_itl_seconds_count", LABELS)] == 1
    assert got[("tokenbus_bridge_tokens_relayed_total", frozenset({("tenant", "acme")}))] == 7
    assert got[("tokenbus_bridge_active_streams", frozenset())] == 0


async def test_an_error_mid_stream_is_counted_by_its_code() -> None:
    metrics = BridgeMetrics()
    error = ChunkError(code="worker_lost", message="gone")
    await _stream(metrics, [chunk(0, 1), chunk(1, 0, FinishReason.ERROR, error=error)])

    got = _samples(metrics)
    assert got[("tokenbus_bridge_completions_total", LABELS | {("code", "worker_lost")})] == 1
    assert ("tokenbus_bridge_itl_seconds_count", LABELS) not in got  # no gap observed


def test_tenants_beyond_the_top_n_are_other_and_their_series_bounded() -> None:
    metrics = BridgeMetrics(tenants=TenantLabels(2))
    for n in range(50):
        labels = metrics.labels(f"t{n}", "tiny-llama", 1)
        metrics.completions.labels(*labels, "ok").inc()
        metrics.ttft.labels(*labels).observe(0.05)

    tenants = {
        dict(labels)["tenant"] for _, labels in _samples(metrics) if dict(labels).get("tenant")
    }
    assert tenants == {"t0", "t1", OTHER}
