"""The README's Kafka ACL table covers every topic tokenbus creates: on a cluster that
denies what no ACL allows, a topic missing there is one that some service cannot use,
or that an operator grants by guesswork."""

from __future__ import annotations

import re
from pathlib import Path

from tokenbus.config import Settings
from tokenbus.topics import Topics
from tokenbus_cli.stack import stack_topics

README = Path(__file__).resolve().parents[2] / "README.md"


def acl_patterns() -> list[re.Pattern[str]]:
    """The topic column of the table under "Kafka ACLs for production", as patterns:
    ``<...>`` any name part, ``*`` anything."""
    text = README.read_text()
    table = text[text.index("**Kafka ACLs for production.**") :]
    table = table[: table.index("\n\n", table.index("| topic |"))]
    patterns = []
    for row in table.splitlines()[3:]:  # after the lead-in line, header and rule
        first = row.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first):
            parts = re.split(r"(<[^>]+>|\*)", name)
            regex = "".join(
                "[^.]+" if p.startswith("<") else ".*" if p == "*" else re.escape(p) for p in parts
            )
            patterns.append(re.compile(regex))
    return patterns


def test_every_topic_the_stack_creates_has_acls() -> None:
    patterns = acl_patterns()
    assert patterns, "no ACL table found"
    topics = Topics()
    created = [
        *stack_topics(Settings()),
        topics.worker("gpu-0"),
        topics.replies("acme.client-1"),
        topics.batch_replies("acme", "batch_0123456789ab"),
    ]
    missing = [t for t in created if not any(p.fullmatch(t) for p in patterns)]
    assert not missing, f"topics with no row in the README's ACL table: {missing}"
