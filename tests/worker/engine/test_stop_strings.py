"""Stop strings over text in pieces: however the text is split, what is released adds up
to the text cut before the first stop string completed (after it, with include_stop_str_in_output);
until the end, nothing released could be the beginning of a stop string."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from preload.worker.engine.stop_strings import StopStrings

letters = st.text(alphabet="ab日🎉", max_size=40)
stops = st.lists(st.text(alphabet="ab日🎉", min_size=1, max_size=5), max_size=4).map(tuple)


def whole(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, bool]:
    """What the whole text says, read from its start: cut before the stop string completed
    first, if any (the longer of two that end together); after it, with `include`."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end if include else end - max(map(len, done))], True
    return text, False


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(text=letters, stops=stops, include=st.booleans(), data=st.data())
def test_released_pieces_add_up_to_the_cut_text(text, stops, include, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    s = StopStrings(stops, include)
    released, stopped = "", False
    for k, piece in enumerate(pieces):
        out, stopped = s.release(piece, last=k == len(pieces) - 1)
        released += out
        if stopped:
            break
        if k < len(pieces) - 1:
            seen = "".join(pieces[: k + 1])
            assert len(released) <= max(0, len(seen) - s.hold)  # the possible start of a stop string is held
    assert (released, stopped) == whole(text, stops, include)


def test_a_stop_string_split_across_pieces_is_found():
    s = StopStrings(("</end>",))
    assert s.release("text </e", last=False) == ("tex", False)  # "t </e" might begin "</end>"
    assert s.release("nd> more", last=False) == ("t ", True)


def test_included_the_stop_string_ends_the_text():
    s = StopStrings(("</end>",), include=True)
    assert s.release("text </e", last=False) == ("tex", False)
    assert s.release("nd> more", last=False) == ("t </end>", True)


def test_without_stop_strings_everything_is_released_at_once():
    assert StopStrings(()).release("abc", last=False) == ("abc", False)
