"""Stop strings: the shown text is the text before the first stop string to complete, however the text arrives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_mlx import DFlashError
from dflash_mlx.decode.stops import StopStrings, stop_list

ALPHABET = "ab\n<>"


@settings(max_examples=200, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1,
                                                             max_size=3), cuts=st.lists(st.integers(0, 40)))
def test_shown_text_is_the_text_before_the_first_stop_however_it_is_cut(text, stops, cuts):
    pieces, last = [], 0
    for cut in sorted(set(c for c in cuts if c <= len(text))) + [len(text)]:
        pieces.append(text[last:cut])
        last = cut
    stopper, shown, found = StopStrings(stops), "", None
    for piece in pieces:
        out, found = stopper.feed(piece)
        shown += out
        assert not any(s in shown for s in stops)  # no stop string is ever shown, even in part and then whole
        if found:
            break
    if not found:
        shown += stopper.flush()
    # Generation ends with the piece that completes a stop: what follows never arrives. So the stop that counts
    # is the earliest-starting one in the text up to the end of that piece (overlapping stops, as '<' and '><<'
    # in '><<', end on different pieces depending on the cuts).
    first, seen = None, ""
    for piece in pieces:
        seen += piece
        if any(s in seen for s in stops):
            first = min((seen.index(s), s) for s in stops if s in seen)
            break
    assert shown == (text if first is None else text[: first[0]])
    assert (found is None) == (first is None) and (first is None or seen.find(found) == first[0])


@pytest.mark.parametrize("bad", [[""], ["ok", 3], [None], 5, {"a": 1}])
def test_stop_strings_must_be_text(bad):
    with pytest.raises(DFlashError, match="stop strings must be non-empty text"):
        stop_list(bad)


def test_request_settings_take_one_stop_string_as_one_stop():
    """RequestSettings built directly (the library's settings object) reads a string as one stop, as the keywords do,
    not as a stop per character."""
    from dflash_mlx.decode.settings import RequestSettings

    assert RequestSettings(stop="\n\n").stop == ("\n\n",)
    assert RequestSettings(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(DFlashError):
        RequestSettings(stop=[""])
