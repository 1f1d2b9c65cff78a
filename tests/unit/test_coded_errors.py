"""One refusal shape: code for machines, message for people, the message as str()."""

from __future__ import annotations

from tokenbus.auth import AuthError
from tokenbus.batch.lines import InputRefused
from tokenbus.batch.submit import BatchRefused
from tokenbus.errors import CodedError


def test_each_refusal_carries_its_code_and_message() -> None:
    auth = AuthError("bad token")
    assert (auth.code, auth.message, str(auth)) == ("invalid_credential", "bad token", "bad token")
    assert AuthError("expired", "token_expired").code == "token_expired"
    refused = InputRefused("empty_file", "the file holds no lines")
    assert (refused.code, refused.message) == ("empty_file", "the file holds no lines")
    batch = BatchRefused(400, "invalid_value", "no such window", "completion_window")
    assert (batch.status, batch.code, batch.message, batch.param) == (
        400,
        "invalid_value",
        "no such window",
        "completion_window",
    )
    assert all(isinstance(e, CodedError) for e in (auth, refused, batch))
    assert isinstance(refused, ValueError) and isinstance(batch, ValueError)
