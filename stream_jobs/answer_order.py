"""Answers to one request id leave the job in the order their seqs were given.

# seq given (ledger written) + turn taken, in one step --> async with turn: send

A request's answers besides its stream (a refusal, a copy's ``duplicate_request``, the
answers owed to the copies taken while it ran) each take the next seq when the job
decides them, and are sent after. Sent as they came, two could reach the reply topic
out of order: the first record to a reply topic waits for the producer's metadata of
it (``tokenbus.metadata`` forgets a topic the producer has been idle on), and a copy's
answer decided meanwhile found the metadata there and went first (seen once in
``test_the_same_request_three_times_runs_once``: seq 61 before 60). A reply topic's
seqs follow one another (README, "One request id, one run").

``AnswerOrder.take(ident)``, called in the same step as the seq is given, returns that
answer's turn; ``async with turn:`` waits for every turn taken before it for the same id,
and ends this one. A turn that is never entered must be ended (``Turn.end``), or every
later answer to that id waits for good.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

Key = tuple[str, str]


class Turn:
    def __init__(self, order: AnswerOrder, ident: Key, before: asyncio.Future[None] | None) -> None:
        self._order = order
        self._ident = ident
        self._before = before
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def __aenter__(self) -> None:
        if self._before is not None:
            try:
                # Shielded: this answer's cancellation must not cancel the one before it.
                await asyncio.shield(self._before)
            except BaseException:
                self.end()
                raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.end()

    def end(self) -> None:
        """Lets the next answer to the id go once the answers before this one have gone
        (idempotent): a turn ended early, never entered or cancelled while it waited,
        must not let the next overtake those."""
        if self._before is None or self._before.done():
            self._finish()
        else:
            self._before.add_done_callback(lambda _: self._finish())

    def _finish(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)
        self._order.forget(self._ident, self.ended)


class AnswerOrder:
    def __init__(self) -> None:
        self._last: dict[Key, asyncio.Future[None]] = {}

    def take(self, ident: Key) -> Turn:
        """The next turn to answer ``ident``: after every turn taken before it."""
        turn = Turn(self, ident, self._last.get(ident))
        self._last[ident] = turn.ended
        return turn

    def forget(self, ident: Key, ended: asyncio.Future[None]) -> None:
        if self._last.get(ident) is ended:
            del self._last[ident]

    def __len__(self) -> int:
        """Request ids with an answer not yet sent."""
        return len(self._last)
