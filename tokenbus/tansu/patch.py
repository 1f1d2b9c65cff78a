"""One private method of a library class, replaced for the whole process, and put back.

# Patch(owner, name).original() --> the method as it ships (kept the first time)
# put(replacement) --> owner.name is the replacement ; undo() --> as it ships again

Every tansu workaround is such a patch (``gaps``, ``fetch_wait``, ``faust_fetch``), so
installing one twice and taking it off again work the same way for all three.
"""

from __future__ import annotations

from typing import Any


class Patch:
    def __init__(self, owner: Any, name: str) -> None:
        self._owner = owner
        self._name = name
        self._original: Any = None
        self.on = False
        """A replacement is in place."""

    def original(self) -> Any:
        """The method as it ships, whatever replacement is in place now."""
        if self._original is None:
            self._original = getattr(self._owner, self._name)
        return self._original

    def put(self, replacement: Any) -> None:
        self.original()
        setattr(self._owner, self._name, replacement)
        self.on = True

    def undo(self) -> None:
        if self._original is not None:
            setattr(self._owner, self._name, self._original)
        self._original = None
        self.on = False
