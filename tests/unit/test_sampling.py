"""tokenbus.sampling: ParentBasedRatio decides as the SDK's ParentBased(TraceIdRatioBased)."""

from __future__ import annotations

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from tokenbus.sampling import ParentBasedRatio

STATE = TraceState([("vendor", "x")])


def parent(*, sampled: bool, remote: bool) -> Context:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    context = SpanContext(0xABC, 0xDEF, is_remote=remote, trace_flags=flags, trace_state=STATE)
    return set_span_in_context(NonRecordingSpan(context))


CONTEXTS = [
    None,
    Context(),
    parent(sampled=True, remote=True),
    parent(sampled=True, remote=False),
    parent(sampled=False, remote=True),
    parent(sampled=False, remote=False),
]
TRACE_IDS = [1, 2**63, 2**64 - 1, (5 << 64) | 7, 0xABC]


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("trace_id", TRACE_IDS)
def test_it_decides_as_the_sdks_chain(ratio: float, context: Context | None, trace_id: int) -> None:
    attributes = {"tokenbus.tenant": "t"}
    ours = ParentBasedRatio(ratio).should_sample(context, trace_id, "s", attributes=attributes)
    sdk = ParentBased(TraceIdRatioBased(ratio)).should_sample(
        context, trace_id, "s", attributes=attributes
    )
    assert ours.decision is sdk.decision
    assert dict(ours.attributes) == dict(sdk.attributes)
    assert ours.trace_state == sdk.trace_state


def test_a_sampled_parent_wins_over_a_ratio_of_zero_and_keeps_its_trace_state() -> None:
    result = ParentBasedRatio(0.0).should_sample(parent(sampled=True, remote=True), 1, "s")
    assert result.decision is Decision.RECORD_AND_SAMPLE
    assert result.trace_state == STATE
    dropped = ParentBasedRatio(1.0).should_sample(parent(sampled=False, remote=False), 1, "s")
    assert dropped.decision is Decision.DROP


def test_it_describes_itself_as_the_sdks_chain() -> None:
    # Through Sampler, whose get_description is typed (ParentBased's is not).
    ours: Sampler = ParentBasedRatio(0.25)
    sdks: Sampler = ParentBased(TraceIdRatioBased(0.25))
    assert ours.get_description() == sdks.get_description()
