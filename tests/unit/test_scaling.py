"""The recommended worker count (stream_jobs.scaling)."""

from stream_jobs.scaling import ScalingPolicy, create_scaling_policy


def test_running_and_waiting_over_the_seats_a_worker_should_fill() -> None:
    policy = ScalingPolicy(target_utilisation=0.8, min_workers=1, max_workers=16)
    # 64 seats at 80%: 51.2 requests per worker.
    assert policy.recommended_workers(0, 0, 64) == 1  # the floor
    assert policy.recommended_workers(51, 0, 64) == 1
    assert policy.recommended_workers(40, 12, 64) == 2
    assert policy.recommended_workers(64, 100, 64) == 4  # ceil(164 / 51.2)
    assert policy.recommended_workers(10_000, 0, 64) == 16  # the ceiling


def test_bounds_come_from_settings_and_zero_may_scale_to_nothing() -> None:
    policy = create_scaling_policy(1.0, 0, 3)
    assert policy.recommended_workers(0, 0, 8) == 0
    assert policy.recommended_workers(0, 9, 8) == 2
    assert create_scaling_policy(1.0, 4, 2).max_workers == 4  # max never below min
