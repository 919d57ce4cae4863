"""Streamed text: what is decided is shown (issue 49, a new user's item 1), and the text is mlx-lm's in the end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from dflash_mlx.decode.generate import streaming_detokenizer
from dflash_mlx.models import fixtures


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The fixtures' byte-level BPE tokenizer (mlx-lm streams it with its BPEStreamingDetokenizer)."""
    folder = tmp_path_factory.mktemp("tok")
    fixtures.write_target(folder, fixtures.target_config("qwen3"))
    return load_tokenizer(folder)


def _pieces(tokenizer) -> list[int]:
    """Token ids of single spaces, runs of spaces, words with and without a leading space, newlines and the bytes of
    a character that spans several tokens."""
    texts = [" ", "  ", "   ", "\n", "\n\n", "Hello", " world", "x", " é", "\t"]
    ids = sorted({i for t in texts for i in tokenizer.encode(t, add_special_tokens=False)})
    return ids + tokenizer.encode("日本", add_special_tokens=False)


def _stream(detokenizer, ids: list[int]) -> tuple[list[str], str]:
    detokenizer.reset()
    shown = []
    for t in ids:
        detokenizer.add_token(t)
        shown.append(detokenizer.last_segment)
    detokenizer.finalize()
    return shown, detokenizer.text


def test_a_run_of_spaces_is_shown_as_it_is_decoded(tokenizer):
    space = tokenizer.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    ids = tokenizer.encode("Hello", add_special_tokens=False) + space * 50
    mlx_lm_shown, _ = _stream(tokenizer.detokenizer, ids)
    ours_shown, _ = _stream(streaming_detokenizer(tokenizer), ids)
    assert "".join(mlx_lm_shown) == "Hello"  # mlx-lm's holds every space while more follow
    assert "".join(ours_shown) == "Hello" + " " * 50
    leading, _ = _stream(streaming_detokenizer(tokenizer), space * 40)  # a reply that starts with spaces
    assert "".join(leading) == " " * 39  # the first is the reply's leading space, dropped as mlx-lm drops it


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_text_is_mlx_lms_and_only_grows(tokenizer, data):
    pool = _pieces(tokenizer)
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=30))
    ours_shown, ours = _stream(streaming_detokenizer(tokenizer), ids)
    _, theirs = _stream(tokenizer.detokenizer, ids)
    assert ours == theirs
    assert ours.startswith("".join(ours_shown))  # what was shown is never taken back


def test_other_detokenizers_are_the_tokenizers_own(tokenizer):
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper

    naive = TokenizerWrapper(tokenizer._tokenizer, NaiveStreamingDetokenizer)
    assert type(streaming_detokenizer(naive)) is NaiveStreamingDetokenizer
