"""Which reply topics a client reads, and when it moves to a fresh one. Pure.

# replies.<client> (one topic, for good)                 rolling off: Apache Kafka
# replies.<client>.0 --> (half full) next one created --> (full) new requests reply to
#   replies.<client>.1, the old one still read --> no stream of ours left on it, and
#   RETIRE_AFTER_S passed --> no longer read, and deleted --> delete_again_after_s later,
#   deleted once more (a producer asking about it meanwhile made it again, empty)

Why (``Settings.reply_topic_roll_records``): the bundled development broker's fetch costs
it more the more record batches a partition holds, and a client's reply topic gains one
per engine step for as long as the client lives. Rolling keeps each partition short.

A client's credentials name its reply topics by prefix: with rolling on, every topic it
replies to is ``<base>.<n>``, owned by the prefix ``<base>.`` (``Principal.owns_reply_topic``);
with it off, the one topic ``<base>``, owned by exactly that name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from tokenbus.clock import SYSTEM_CLOCK, Clock

RETIRE_AFTER_S = 30.0
"""How long an old reply topic is still read after new requests stopped replying to it,
once no stream of the client reads there: room for answers that come after a stream's
end (a copy's ``duplicate_request``)."""


class ReplyTopics:
    def __init__(
        self,
        base: str,
        roll_after: int | None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        retire_after_s: float | None = None,
        delete_again_after_s: float = 30.0,
    ) -> None:
        """``roll_after``: records in the current topic before new requests reply to the
        next one; None: never (one topic, ``base``). ``delete_again_after_s``: by then no
        producer asks the broker about a topic deleted before (``tokenbus.metadata``)."""
        self._base = base
        self._roll_after = roll_after
        self._clock = clock
        self._retire_after_s = RETIRE_AFTER_S if retire_after_s is None else retire_after_s
        self._generation = 0
        self.current = self._name(0)
        self._next: str | None = None
        self._preparing: str | None = None
        self._retired: dict[str, float] = {}
        """Old topics still read --> when new requests stopped replying to them."""
        self._delete_again_after_s = delete_again_after_s
        self._deleted: dict[str, float] = {}
        """Old topics deleted once --> when."""

    @property
    def rolls(self) -> bool:
        """Whether the client ever moves to another topic."""
        return self._roll_after is not None

    @property
    def prefix(self) -> str:
        """The reply prefix a credential minted for this client carries: it owns every
        topic the client will reply to."""
        return self._base if self._roll_after is None else f"{self._base}."

    @property
    def read(self) -> list[str]:
        """The topics to read: the old ones still read, then the current one."""
        return [*self._retired, self.current]

    @property
    def owned(self) -> list[str]:
        """Every topic of this client's that exists, or may: to delete on close."""
        pending = [t for t in (self._next, self._preparing) if t is not None]
        return [*self.read, *pending, *self._deleted]

    def wants_next(self, num_records: int) -> str | None:
        """The next topic, once, when the current one (``num_records`` in it) is half
        full: made ahead, so that moving to it never waits for the broker."""
        if self._roll_after is None or self._next or self._preparing:
            return None
        if num_records < self._roll_after // 2:
            return None
        self._preparing = self._name(self._generation + 1)
        return self._preparing

    def ready(self, topic: str) -> None:
        """``topic`` (from ``wants_next``) exists."""
        if topic == self._preparing:
            self._next, self._preparing = topic, None

    def not_ready(self, topic: str) -> None:
        """Making ``topic`` failed: the next ``wants_next`` asks again."""
        if topic == self._preparing:
            self._preparing = None

    def switch(self, num_records: int) -> bool:
        """Whether new requests now reply to the next topic: the current one holds
        ``num_records``, at least ``roll_after``, and the next one is ready."""
        if self._roll_after is None or self._next is None or num_records < self._roll_after:
            return False
        self._retired[self.current] = self._clock.monotonic()
        self.current, self._next = self._next, None
        self._generation += 1
        return True

    def retire(self, in_use: Callable[[], Collection[str]]) -> list[str]:
        """The old topics to stop reading and delete: no stream reads there (``in_use``
        gives the topics of the client's open streams, asked only once one is due), and
        ``RETIRE_AFTER_S`` has passed."""
        now = self._clock.monotonic()
        due = [t for t, since in self._retired.items() if now - since >= self._retire_after_s]
        if not due:
            return []
        reading = set(in_use())
        done = [topic for topic in due if topic not in reading]
        for topic in done:
            del self._retired[topic]
            self._deleted[topic] = now
        return done

    def delete_again(self) -> list[str]:
        """The topics deleted ``delete_again_after_s`` ago, to delete once more (once): a
        broker that makes topics on demand made one again, empty, if a producer asked
        about it before it let the topic go."""
        now = self._clock.monotonic()
        again = [t for t, at in self._deleted.items() if now - at >= self._delete_again_after_s]
        for topic in again:
            del self._deleted[topic]
        return again

    def _name(self, generation: int) -> str:
        return self._base if self._roll_after is None else f"{self._base}.{generation}"
