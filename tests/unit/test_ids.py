from __future__ import annotations

from tokenbus.ids import is_session_id, new_session_id, ulid


def test_ulids_sort_by_time_and_are_26_crockford_chars() -> None:
    earlier, later = ulid(now_ms=1_000), ulid(now_ms=2_000)
    assert len(earlier) == 26 and earlier < later


def test_session_ids_are_recognised_and_unique() -> None:
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(is_session_id(i) for i in ids)
    assert not is_session_id("sess_short") and not is_session_id("req_" + "0" * 26)
