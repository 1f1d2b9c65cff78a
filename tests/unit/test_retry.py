from tokenbus.retry import Backoff


def test_backoff_doubles_from_initial_and_is_capped() -> None:
    backoff = Backoff(initial_s=0.5, factor=2.0, max_s=3.0)

    assert [backoff.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
