from __future__ import annotations

import math

import pytest

from bench import capacity as cap

COSTS = cap.Costs(
    job_us_per_request=1000.0,
    pick_us_per_worker=0.5,
    billing_us_per_event=40.0,
    worker_loop_us_per_token=50.0,
    bridge_us_per_token=40.0,
    broker_us_per_token=20.0,
    relay_tokens_per_record=2.0,
    request_record_bytes=1000.0,
    reply_record_bytes=150.0,
    reply_bytes_per_extra_chunk=100.0,
    usage_record_bytes=500.0,
)


def test_cores_per_gpu_are_rate_times_cost() -> None:
    cores = cap.cores_per_gpu(COSTS, cap.GpuRates())
    assert cores == pytest.approx({"stream_job": 0.02, "bridge": 0.22, "billing": 0.0008})


def test_the_jobs_cost_per_request_grows_with_the_workers_a_pick_reads() -> None:
    assert cap.job_us_per_request(COSTS, 1) == 1000.0
    assert cap.job_us_per_request(COSTS, 513) == pytest.approx(1000.0 + 512 * 0.5)
    per_gpu = cap.cores_per_gpu(COSTS, cap.GpuRates(), num_gpus=513)
    assert per_gpu["stream_job"] == pytest.approx(20 * 1256e-6)
    fleet = cap.fleet(COSTS, cap.GpuRates(), 513)
    assert fleet.cores["stream_job"] == pytest.approx(513 * 20 * 1256e-6)


def test_cores_between_all_per_token_and_all_per_record() -> None:
    # 1,000 tokens/s in 100 records/s; measured 10 µs/token at 2 tokens per record.
    assert cap.cores_between(10.0, 2.0, 1000, 100) == pytest.approx((0.002, 0.01))
    # Records here fuller than the relay's: per record is the lower bound.
    assert cap.cores_between(10.0, 2.0, 1000, 250) == pytest.approx((0.005, 0.01))


def test_relay_tokens_per_record() -> None:
    assert cap.relay_tokens_per_record(64, 1, 1) == 64
    assert cap.relay_tokens_per_record(64, 10, 4) == pytest.approx(256 / (10 * (1 - 0.9**64)))


def test_running_requests_by_littles_law() -> None:
    assert cap.GpuRates(tokens_per_s=5500, step_ms=20).num_running == pytest.approx(110)


def test_distinct_keys() -> None:
    assert cap.distinct_keys(1, 110) == 1.0
    assert cap.distinct_keys(1, 0) == 0.0
    # Many more keys than requests: nearly every request is a record of its own.
    assert cap.distinct_keys(1e9, 110) == pytest.approx(110, rel=1e-6)
    assert cap.distinct_keys(2, 2) == pytest.approx(1.5)


def test_instances_round_up_at_the_planned_share_of_a_core() -> None:
    assert cap.instances(0.0) == 1
    assert cap.instances(0.7) == 1
    assert cap.instances(0.71) == 2
    assert cap.instances(7.0) == 10


def test_fleet_of_one_bridge_and_one_tenant_sends_one_record_per_step() -> None:
    rates = cap.GpuRates(tokens_per_s=5500, requests_per_s=20, step_ms=20, num_tenants=1)
    f = cap.fleet(COSTS, rates, 1)
    assert f.instances == {"stream_job": 1, "bridge": 1, "billing": 1}
    assert f.reply_records_per_s == pytest.approx(50)
    assert f.tokens_per_reply_record == pytest.approx(110)
    assert f.request_records_per_s == 60
    reply_bytes = 50 * (150 + 109 * 100)
    assert f.bytes_per_s == pytest.approx(reply_bytes + 20 * (2 * 1000 + 500))
    assert f.reply_mb_s_per_topic == pytest.approx(reply_bytes / 1e6)
    # 5,500 tokens/s at 20 µs: 0.11 cores; 50 records/s at 20 µs x 2 tokens: 0.002.
    assert f.broker_cores_tansu == pytest.approx((0.002, 0.11))
    assert f.worker_loop_cores == pytest.approx((50 * 50 * 2 / 1e6, 5500 * 50 / 1e6))
    assert f.records_per_s == pytest.approx(110)
    assert f.reply_records_per_s_per_topic == pytest.approx(50)


def test_more_bridges_and_tenants_thin_the_records_towards_one_token() -> None:
    small, large = (cap.fleet(COSTS, cap.GpuRates(), n) for n in (8, 512))
    assert large.instances["bridge"] == math.ceil(512 * 0.22 / 0.7)
    assert large.tokens_per_reply_record < small.tokens_per_reply_record
    assert 1.0 <= large.tokens_per_reply_record < 1.01
    # 1,000 µs a request, and 0.5 more for each of the other 511 workers a pick reads.
    assert large.cores["stream_job"] == pytest.approx(512 * 20 * (1000 + 511 * 0.5) / 1e6)
    # Records of ~1 token, thinner than the relay's 2: per record is the upper bound.
    low, high = large.worker_loop_cores
    assert low == pytest.approx(512 * 5500 * 50 / 1e6)
    assert high == pytest.approx(large.reply_records_per_s * 50 * 2 / 1e6)


def test_costs_from_summary_names_what_is_missing() -> None:
    costs, missing = cap.costs_from_summary({"figures": {}, "record_bytes": {}})
    assert costs is None
    assert "admission.job_us_per_request" in missing
    assert "record_bytes.usage_event" in missing


def test_costs_from_summary_converts_rates_to_costs() -> None:
    figures = {key: {"median": 10.0} for key in cap.SOURCES.values()}
    figures["billing.events_per_core_s"] = {"median": 25_000.0}
    figures["bridge.tokens_per_core_s"] = {"median": 20_000.0}
    sizes = {"reply_record_one_chunk": 150, "reply_record_per_extra_chunk": 90, "usage_event": 500}
    costs, missing = cap.costs_from_summary({"figures": figures, "record_bytes": sizes})
    assert missing == []
    assert costs is not None
    assert costs.billing_us_per_event == 40.0
    assert costs.bridge_us_per_token == 50.0
    assert costs.job_us_per_request == 10.0
    assert costs.pick_us_per_worker == 10.0
    assert costs.reply_bytes_per_extra_chunk == 90.0
