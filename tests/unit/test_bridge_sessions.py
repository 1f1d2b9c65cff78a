from __future__ import annotations

import pytest

from bridge.sessions import SessionIssuer
from tokenbus.ids import is_session_id, new_session_id

SECRET = b"s" * 32


def test_issued_ids_are_session_ids_owned_by_their_tenant_only() -> None:
    issuer = SessionIssuer(SECRET)
    session = issuer.issue("tenant-a")
    assert is_session_id(session)
    assert issuer.owned_by(session, "tenant-a")
    assert not issuer.owned_by(session, "tenant-b")


def test_resolve_honours_own_sessions_and_replaces_others() -> None:
    issuer = SessionIssuer(SECRET)
    mine = issuer.issue("tenant-a")
    theirs = issuer.issue("tenant-b")
    assert issuer.resolve(mine, "tenant-a") == mine
    replaced = issuer.resolve(theirs, "tenant-a")
    assert replaced != theirs and issuer.owned_by(replaced, "tenant-a")
    for bogus in (None, "", "hello", new_session_id(), "sess_" + "Z" * 26):
        fresh = issuer.resolve(bogus, "tenant-a")
        assert fresh != bogus and issuer.owned_by(fresh, "tenant-a")


def test_another_instance_with_the_same_secret_agrees_and_another_secret_does_not() -> None:
    session = SessionIssuer(SECRET).issue("tenant-a")
    assert SessionIssuer(SECRET).owned_by(session, "tenant-a")
    assert not SessionIssuer(b"t" * 32).owned_by(session, "tenant-a")


def test_tampering_with_any_character_breaks_ownership() -> None:
    issuer = SessionIssuer(SECRET)
    session = issuer.issue("tenant-a")
    body = session.removeprefix("sess_")
    for i in range(10, 26):  # the random and MAC characters
        swapped = "0" if body[i] != "0" else "1"
        forged = "sess_" + body[:i] + swapped + body[i + 1 :]
        assert not issuer.owned_by(forged, "tenant-a")


def test_ids_are_distinct_and_time_ordered() -> None:
    issuer = SessionIssuer(SECRET)
    first = issuer.issue("t", now_ms=1_000)
    second = issuer.issue("t", now_ms=2_000)
    assert first < second
    assert len({issuer.issue("t") for _ in range(1000)}) == 1000


def test_short_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        SessionIssuer(b"short")
