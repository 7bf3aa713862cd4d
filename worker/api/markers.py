"""Text that streams while a marker (a tool call's opening, </think>) may be arriving."""

from __future__ import annotations


def unmarked_end(text: str, marker: str) -> int:
    """How much of `text` can be shown now: all but its longest tail that begins `marker`
    (that tail is held back until the next piece says whether the marker came)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)
