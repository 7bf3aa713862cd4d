"""Stop strings over text that arrives in pieces: where the first one begins, and which
text is safe to show before the sequence ends.

The last `longest stop string - 1` characters are held back: they might turn out to be
the beginning of a stop string. Each piece is searched together with what is held, so
a stop string split across pieces is found, and no character is searched more than a
stop string's length of times.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...], include: bool = False):
        """include: the text ends after the stop string rather than before it
        (include_stop_str_in_output)."""
        self.stops, self.include = stops, include
        self.hold = max(map(len, stops), default=1) - 1
        self.held = ""

    def release(self, new: str, last: bool) -> tuple[str, bool]:
        """The text grew by `new` (`last`: and will not grow again). Returns the text now
        safe to show, and whether a stop string ended the text: the text then ends right
        before the first one completed (after it, with `include`), and nothing more will be
        released."""
        window = self.held + new
        # The stop string completed first (of two that end together, the longer): what a
        # reader of the text token by token meets first, however the text was split.
        found = [(i + len(s), i) for i, s in ((window.find(s), s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            end, start = min(found)
            return window[: end if self.include else start], True
        keep = 0 if last else min(self.hold, len(window))
        self.held = window[len(window) - keep :]
        return window[: len(window) - keep], False
