"""`TextStream`: however the tokens arrive, the released pieces add up to the text, cut before the
first stop sequence, and nothing is released that a later token could still change."""

from __future__ import annotations

import itertools

from conftest import CHARS, char_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from specboost.decoder.serve.text_stream import TextStream

TOKENIZER = char_tokenizer()


def _ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="bcd.", min_size=0, max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    stops=st.lists(st.text(alphabet="bcd.", min_size=1, max_size=3), max_size=3),
)
def test_pieces_add_up_to_the_text_cut_at_the_first_stop(text, cuts, stops):
    ids = _ids(text)
    bounds = sorted({0, len(ids), *(min(c, len(ids)) for c in cuts)})
    stream = TextStream(TOKENIZER, stops)
    pieces = [stream.add(ids[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.finish()]
    # the stop completed first (earliest end, then earliest start): generation ends there
    ends = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    first = min(ends)[1] if ends else len(text)
    assert "".join(pieces) == text[:first]
    assert stream.text == text[:first]
    assert stream.stopped == any(s in text for s in stops)


def test_the_stop_completed_first_cuts_the_text_however_the_tokens_arrive():
    # "dbd" starts before "b" but completes after it: generation ends at "b", chunks or not
    for chunks in (["dbd"], ["db", "d"], ["d", "b", "d"]):
        stream = TextStream(TOKENIZER, ["b", "dbd"])
        assert "".join(stream.add(_ids(c)) for c in chunks) + stream.finish() == "d"


def test_a_tail_that_may_become_a_stop_sequence_is_held_back():
    stream = TextStream(TOKENIZER, ["bcd"])
    assert stream.add(_ids("xxbc")) == "xx"  # "bc" may still become "bcd"
    assert stream.add(_ids("e")) == "bce"
    assert stream.add(_ids("bc")) == ""
    assert stream.add(_ids("d")) == ""  # the stop sequence: the text ends before it
    assert stream.stopped and stream.text == "xxbce"
    assert stream.add(_ids("zz")) == "" and stream.finish() == ""
