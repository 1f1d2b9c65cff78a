"""tokenbus.tansu.patch: a method replaced for the process keeps its shipped original."""

from __future__ import annotations

from tokenbus.tansu.patch import Patch


class Library:
    def method(self) -> str:
        return "shipped"


SHIPPED = Library.method


def test_a_patch_replaces_keeps_the_shipped_method_and_puts_it_back() -> None:
    patch = Patch(Library, "method")
    assert not patch.on
    patch.put(lambda self: "first")
    assert patch.on and Library().method() == "first"
    # A second replacement still wraps the method as it ships, not the first replacement.
    original = patch.original()
    patch.put(lambda self: "second " + original(self))
    assert Library().method() == "second shipped"
    patch.undo()
    assert not patch.on and Library.method is SHIPPED and Library().method() == "shipped"
    patch.undo()  # taking it off twice changes nothing
    assert Library.method is SHIPPED
