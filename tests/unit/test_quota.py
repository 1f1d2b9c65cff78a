from __future__ import annotations

from stream_jobs.quota import MinuteTokenQuota, estimate_prompt_tokens


def test_admits_until_the_limit_then_says_when_to_retry() -> None:
    quota = MinuteTokenQuota()
    assert quota.reserve_tokens("a", 60, limit=100, now=0.0).admitted
    refused = quota.reserve_tokens("a", 50, limit=100, now=15.0)
    assert not refused.admitted
    assert refused.retry_after_s == 45.0
    assert refused.used == 60


def test_tenants_have_separate_windows() -> None:
    quota = MinuteTokenQuota()
    assert quota.reserve_tokens("a", 100, limit=100, now=0.0).admitted
    assert quota.reserve_tokens("b", 100, limit=100, now=0.0).admitted
    assert not quota.reserve_tokens("a", 1, limit=100, now=1.0).admitted


def test_a_new_window_starts_after_sixty_seconds() -> None:
    quota = MinuteTokenQuota()
    quota.reserve_tokens("a", 100, limit=100, now=0.0)
    assert quota.reserve_tokens("a", 100, limit=100, now=60.0).admitted


def test_settling_refunds_unused_tokens() -> None:
    quota = MinuteTokenQuota()
    quota.reserve_tokens("a", 90, limit=100, now=0.0)
    quota.reconcile_usage("a", reserved=90, actual=30, now=1.0)
    assert quota.reserve_tokens("a", 70, limit=100, now=2.0).admitted
    assert not quota.reserve_tokens("a", 1, limit=100, now=2.0).admitted


def test_settling_charges_an_overrun() -> None:
    quota = MinuteTokenQuota()
    quota.reserve_tokens("a", 10, limit=100, now=0.0)
    quota.reconcile_usage("a", reserved=10, actual=95, now=1.0)
    assert not quota.reserve_tokens("a", 10, limit=100, now=2.0).admitted


def test_prompt_estimate_never_undercounts_a_byte_level_tokenizer() -> None:
    assert estimate_prompt_tokens("héllo") == 6
