"""The one shape of a refusal a caller can act on: a machine-readable ``code`` (what an
API answers, a dead-letter reason) and a ``message`` a person reads.

# AuthError (tokenbus.auth), InputRefused and BatchRefused (tokenbus.batch) --> CodedError
"""

from __future__ import annotations


class CodedError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
