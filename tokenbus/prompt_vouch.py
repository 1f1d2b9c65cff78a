"""A prompt's token count, vouched for by the tokenbus service that counted it.

The bridge counts every prompt with the served model's tokenizer (its 413, the token's
quota balance), and the job needs the same count for the quota's reservation. Counting
it twice is about a seventh of the job's CPU per request (BENCHMARKS.md). So the
bridge's client sends its count on the request record, in the header
``tokenbus-prompt-tokens``, as ``<count>.<mac>``: an HMAC-SHA256, under the bus's
service secret, of the count and the record's exact value. The job believes it only
from a record whose credential is a service token, and only when the MAC matches that
record's value; anything else (no header, a producer's own header, a count copied onto
another request) and the job counts the prompt itself, as for any program's request.

A vouched count is as good as the job's own only if both count with the same
tokenizer: the bridge and the job read the same ``model_dir``, and the bridge vouches
only for a count made with the tokenizer file, never for its estimate without one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

HEADER = "tokenbus-prompt-tokens"
_DOMAIN = b"tokenbus-prompt-tokens\x00"
MAX_COUNT = 10_000_000
"""Larger than any context: a count above it is not one this module makes."""


def _mac(secret: bytes, count: int, value: bytes) -> bytes:
    digest = hmac.digest(secret, _DOMAIN + str(count).encode() + b"\x00" + value, hashlib.sha256)
    return base64.urlsafe_b64encode(digest).rstrip(b"=")


def vouch(secret: str, value: bytes, count: int) -> bytes:
    """The header's value for a request record whose value is ``value``."""
    if not 0 <= count <= MAX_COUNT:
        raise ValueError(f"a prompt count must be 0 to {MAX_COUNT}, not {count}")
    return str(count).encode() + b"." + _mac(secret.encode(), count, value)


def vouched(secret: str, value: bytes, header: bytes | None) -> int | None:
    """The count the header vouches for, if its MAC is that of this value; else None."""
    if not header or len(header) > 64:
        return None
    digits, dot, mac = header.partition(b".")
    if not dot or not digits.isdigit():
        return None
    count = int(digits)
    if count > MAX_COUNT or digits != str(count).encode():  # one spelling per count
        return None
    if not hmac.compare_digest(mac, _mac(secret.encode(), count, value)):
        return None
    return count
