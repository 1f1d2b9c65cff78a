"""The bridge's metrics (bridge.metrics) and where the gateway records them: a stream's
outcome and its mean inter-token latency, once at its end; tenants bounded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

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


class Replies:
    """A request's chunks as ``ReplyStream`` gives them: each arriving after the last
    was written, or (``at_hand``) all of them here at once."""

    def __init__(self, chunks: list[Chunk], *, at_hand: bool = False) -> None:
        self._chunks = chunks
        self._at_hand = at_hand
        self.closed = False

    async def get(self, timeout_s: float | None) -> Chunk | None:
        return self._chunks.pop(0)

    def ready(self) -> Chunk | None:
        return self._chunks.pop(0) if self._at_hand and self._chunks else None

    def close(self) -> None:
        self.closed = True


def _gateway(metrics: BridgeMetrics) -> Gateway:
    none: Any = None
    return Gateway(Settings(), none, none, none, none, none, metrics, none)


def chunk(seq: int, n: int, finish: FinishReason | None = None, **kw: Any) -> Chunk:
    return Chunk("r1", "acme", seq, text="x" * n, num_tokens=n, finish_reason=finish, **kw)


async def _stream(
    metrics: BridgeMetrics, chunks: list[Chunk], *, at_hand: bool = False
) -> list[bytes]:
    """The writes of the stream of ``chunks``, the first one already read."""
    labels = metrics.labels("acme", "tiny-llama", 1)
    caller = SimpleNamespace(tenant=SimpleNamespace(tpm=1000))
    request: Any = SimpleNamespace(request_id="r1")
    events = _gateway(metrics)._events(
        Replies(chunks[1:], at_hand=at_hand),  # type: ignore[arg-type]
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


async def test_chunks_at_hand_go_out_in_one_write_with_the_same_bytes() -> None:
    chunks = [chunk(0, 1), chunk(1, 2), chunk(2, 3), chunk(3, 1), chunk(4, 1, FinishReason.STOP)]
    one_by_one, at_once = BridgeMetrics(), BridgeMetrics()
    apart = await _stream(one_by_one, chunks)
    joined = await _stream(at_once, chunks, at_hand=True)

    assert b"".join(joined) == b"".join(apart)
    assert len(apart) == 6  # five events, then [DONE]
    assert len(joined) == 2  # the five events; [DONE]
    assert joined[-1] == DONE
    relayed = ("tokenbus_bridge_tokens_relayed_total", frozenset({("tenant", "acme")}))
    assert _samples(at_once)[relayed] == _samples(one_by_one)[relayed] == 8


async def test_an_error_among_chunks_at_hand_follows_the_events_before_it() -> None:
    error = ChunkError(code="worker_lost", message="gone")
    chunks = [chunk(0, 1), chunk(1, 2), chunk(2, 1), chunk(3, 0, FinishReason.ERROR, error=error)]
    one_by_one, at_once = BridgeMetrics(), BridgeMetrics()
    apart = await _stream(one_by_one, chunks)
    joined = await _stream(at_once, chunks, at_hand=True)

    assert b"".join(joined) == b"".join(apart)
    assert b"worker_lost" in joined[-2] and joined[-1] == DONE
    assert len(joined) == 2
    assert joined[0].count(b"data: ") == 4  # three token events and the error, one write
    got = _samples(at_once)
    assert got[("tokenbus_bridge_completions_total", LABELS | {("code", "worker_lost")})] == 1
    assert got[("tokenbus_bridge_tokens_relayed_total", frozenset({("tenant", "acme")}))] == 4


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
