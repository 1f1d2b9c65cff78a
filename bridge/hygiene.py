"""Input hygiene: screen a normalized copy for risky patterns, pass the original on.

Pure functions and one small class. The engine gets the client's text as sent, as vLLM's
own server would give it, save what is unsafe to pass on at all (``pass_text``: NUL,
and lone surrogates, which UTF-8 cannot carry). A tenant may choose to have its text
rewritten (``rewrite_text``, the tenant setting ``rewrite_prompts``).

The screen never sees the text as sent, but a copy (``screen_copy``): NFKC folds
look-alikes (full-width letters, ligatures) into plain ones, case is folded, and
invisible characters (control, format such as zero-width and bidi overrides, and the
Hangul fillers) are removed, so the screen reads "ignore" however it was typed: in
full-width letters, in mixed case, or with zero-width spaces between its letters.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

KEPT_CONTROLS = frozenset("\t\n\r")
DROPPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
INVISIBLE = frozenset("\u034f\u115f\u1160\u3164\uffa0")
"""Not format characters, yet shown as nothing: combining grapheme joiner, Hangul fillers."""

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


def pass_text(text: str) -> str:
    """The text as sent, less NUL and lone surrogates (which cannot even be encoded)."""
    if text.isascii():
        return text.replace("\x00", "")
    return "".join(ch for ch in text if ch != "\x00" and not "\ud800" <= ch <= "\udfff")


def rewrite_text(text: str) -> str:
    """For tenants who opt in: NFKC, and control (but tab and newlines), format and
    surrogate characters removed. This changes what the model sees."""
    normalized = unicodedata.normalize("NFKC", text)
    return "".join(
        ch
        for ch in normalized
        if ch in KEPT_CONTROLS or unicodedata.category(ch) not in DROPPED_CATEGORIES
    )


def screen_copy(text: str) -> str:
    """What the screen reads: NFKC, case-folded, invisible characters removed."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return "".join(
        ch
        for ch in folded
        if ch in KEPT_CONTROLS
        or (unicodedata.category(ch) not in DROPPED_CATEGORIES and ch not in INVISIBLE)
    )


@dataclass(frozen=True)
class Finding:
    flag: str
    pattern: str


class PatternScreen:
    """Case-insensitive regexes, matched against each text's ``screen_copy``; each
    match becomes a flag on the request."""

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
            text = screen_copy(text)
            for flag, regex in self._rules:
                if flag not in found and regex.search(text):
                    found[flag] = Finding(flag, regex.pattern)
        return list(found.values())
