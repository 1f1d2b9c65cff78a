"""Input hygiene: normalize text, strip control characters, screen for risky patterns.

Pure functions and one small class; the handlers apply them to every prompt and chat
message before anything is tokenized or produced.

NFKC folds look-alike characters (full-width letters, ligatures) into plain ones, so
the screen sees "ignore" however it was typed. Control (Cc, except tab and newlines),
format (Cf: zero-width and bidi overrides, used to hide text) and surrogate (Cs, which
cannot even be encoded as UTF-8) characters are removed.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

KEPT_CONTROLS = frozenset("\t\n\r")
DROPPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})

INJECTION_FLAG = "injection_suspected"
SENSITIVE_FLAG = "sensitive_data_suspected"

DEFAULT_INJECTION_PATTERNS = (
    r"\bignore\s+(?:all\s+|any\s+|the\s+)?(?:previous|prior|above|earlier)\s+"
    r"(?:instructions|prompts|messages|rules)",
    r"\bdisregard\s+(?:all\s+|the\s+|your\s+)?(?:previous\s+|prior\s+|system\s+)?"
    r"(?:instructions|prompt|rules)",
    r"\b(?:reveal|print|show|repeat)\s+(?:me\s+)?(?:your|the)\s+(?:system\s+prompt|"
    r"hidden\s+instructions|initial\s+instructions)",
    r"\byou\s+are\s+now\s+(?:in\s+)?(?:developer|jailbreak|dan)\b",
)
DEFAULT_SENSITIVE_PATTERNS = (
    r"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----",
    r"\bAKIA[0-9A-Z]{16}\b",  # AWS access key ID
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{20,}\b",  # API secret keys in the common shape
    r"\b\d{3}-\d{2}-\d{4}\b",  # US social security number
    r"\b(?:\d[ -]?){12,18}\d\b",  # card-number-like digit runs
)


def clean_text(text: str) -> str:
    normalized = unicodedata.normalize("NFKC", text)
    return "".join(
        ch
        for ch in normalized
        if ch in KEPT_CONTROLS or unicodedata.category(ch) not in DROPPED_CATEGORIES
    )


@dataclass(frozen=True)
class Finding:
    flag: str
    pattern: str


class PatternScreen:
    """Case-insensitive regexes; each match becomes a flag on the request."""

    def __init__(self, injection: Iterable[str], sensitive: Iterable[str]) -> None:
        self._rules = [(INJECTION_FLAG, re.compile(p, re.IGNORECASE)) for p in injection] + [
            (SENSITIVE_FLAG, re.compile(p, re.IGNORECASE)) for p in sensitive
        ]

    @classmethod
    def create(
        cls, injection: Iterable[str] | None, sensitive: Iterable[str] | None
    ) -> PatternScreen:
        return cls(
            DEFAULT_INJECTION_PATTERNS if injection is None else injection,
            DEFAULT_SENSITIVE_PATTERNS if sensitive is None else sensitive,
        )

    def scan(self, texts: Iterable[str]) -> list[Finding]:
        """At most one finding per flag: the first pattern that matched it."""
        found: dict[str, Finding] = {}
        for text in texts:
            for flag, regex in self._rules:
                if flag not in found and regex.search(text):
                    found[flag] = Finding(flag, regex.pattern)
        return list(found.values())
