"""A request's trace as a page (billing.trace_page): bars on a time axis, every attempt,
every value escaped."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime

from billing.trace_page import render_problem, render_trace
from billing.traces import Step

NOW = datetime(2026, 3, 2, 12, tzinfo=UTC)
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def step(
    name: str,
    service: str,
    depth: int,
    offset: float,
    duration: float,
    *,
    attempt: int = -1,
    status: str = "ok",
    trace_id: str = TRACE,
    attributes: Mapping[str, object] | None = None,
) -> Step:
    return Step(
        depth=depth,
        offset_ms=offset,
        duration_ms=duration,
        name=name,
        service=service,
        status=status,
        attempt=attempt,
        trace_id=trace_id,
        attributes=tuple(sorted((k, str(v)) for k, v in (attributes or {}).items())),
    )


def resumed() -> list[Step]:
    """A request whose first worker was lost: both attempts in its one trace."""
    worker = {"tokenbus.tenant": "acme", "tokenbus.request_id": "r1"}
    return [
        step("bridge.request", "tokenbus-bridge", 0, 0.0, 400.0),
        step("job.admit", "tokenbus-job", 1, 10.0, 2.0),
        step(
            "worker.request",
            "tokenbus-worker",
            2,
            20.0,
            100.0,
            attempt=0,
            status="error",
            attributes={**worker, "tokenbus.attempt": 0, "tokenbus.worker": "worker-0"},
        ),
        step(
            "worker.request",
            "tokenbus-worker",
            2,
            200.0,
            200.0,
            attempt=1,
            attributes={**worker, "tokenbus.attempt": 1, "tokenbus.worker": "worker-1"},
        ),
    ]


def test_every_span_is_a_bar_on_its_trace_s_time_axis() -> None:
    page = render_trace("r1", "acme", resumed(), generated_at=NOW)

    assert "<h1>request r1 of tenant acme</h1>" in page
    assert f"<h2>trace {TRACE}</h2>" in page
    assert "4 spans over 400.0 ms" in page and "attempts 0, 1" in page
    # Bars are placed in percent of the axis, whose last tick (400 ms) is the right edge.
    bars = re.findall(r'class="bar( error)?" style="margin-left:([\d.]+)%;width:([\d.]+)%"', page)
    assert bars == [
        ("", "0.00", "100.00"),
        ("", "2.50", "0.50"),
        (" error", "5.00", "25.00"),
        ("", "50.00", "50.00"),
    ]
    assert '<span style="left:50.00%">200 ms</span>' in page
    # Both attempts, each with its worker; the tenant and the page's request id are
    # the page's own, not repeated on every span.
    assert "<code>attempt=0</code> <code>worker=worker-0</code>" in page
    assert "<code>attempt=1</code> <code>worker=worker-1</code>" in page
    assert "tokenbus.tenant" not in page and "request_id=r1" not in page
    assert (
        '<td class="span">&nbsp;&nbsp;&nbsp;&nbsp;worker.request <b class="error">error</b></td>'
        "<td>tokenbus-worker</td><td>20.0</td><td>100.0</td><td>0</td>"
    ) in page
    assert "<td>tokenbus-job</td><td>10.0</td><td>2.0</td><td>-</td>" in page
    assert page.index("worker-0") < page.index("worker-1")


def test_each_trace_that_names_the_request_has_its_own_axis() -> None:
    other = "0" * 31 + "1"
    steps = [*resumed()[:2], step("client.request", "tokenbus-client", 0, 0.0, 5.0, trace_id=other)]
    page = render_trace("r1", "acme", steps, generated_at=NOW)

    assert page.count("<h2>trace ") == 2
    assert "2 spans over 400.0 ms" in page and "1 span over 5.0 ms" in page


def test_hostile_values_are_escaped_everywhere() -> None:
    hostile = '"><script>alert(1)</script>'
    steps = [
        step(
            hostile,
            f"svc{hostile}",
            0,
            0.0,
            1.0,
            trace_id=f"t{hostile}",
            attributes={f"k{hostile}": hostile, "tokenbus.request_id": f"other{hostile}"},
        )
    ]
    page = render_trace(f"r{hostile}", f"a{hostile}", steps, generated_at=NOW)

    assert "<script>" not in page and "alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # A request id other than the page's is shown, escaped.
    assert "<code>request_id=other&quot;&gt;&lt;script&gt;" in page


def test_a_problem_page_says_why_escaped() -> None:
    page = render_problem("no trace", "no spans of request <b>x</b>", generated_at=NOW)

    assert "<h1>no trace</h1>" in page
    assert '<p class="error">no spans of request &lt;b&gt;x&lt;/b&gt;</p>' in page
    assert "<b>x" not in page
