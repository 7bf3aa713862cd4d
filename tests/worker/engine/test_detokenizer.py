"""The detokenizer: the text it gives a token at a time, plus `finish`, is exactly what
`Tokenizer.decode` makes of the whole output, for the bundled model's byte-level BPE and
the tests' word-level tokenizer, over random token sequences. (What it costs is in
test_stream_cost.py.)"""

from __future__ import annotations

import pytest
from checkpoints import write_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from preload import BUNDLED_MODEL
from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.engine.detokenizer import Detokenizer


def bundled() -> Tokenizer:
    return Tokenizer.from_dir(BUNDLED_MODEL)


def word_level(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("word-level")
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module", params=["byte-level BPE", "word-level"])
def tok(request, tmp_path_factory) -> Tokenizer:
    return bundled() if request.param == "byte-level BPE" else word_level(tmp_path_factory)


def troublesome(tok: Tokenizer) -> list[int]:
    """Tokens that give no text alone: special tokens and pieces of characters."""
    special = [tok.eos_id, tok.bos_id, *range(5)]
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    return sorted({t for t in special + partial if t is not None and t < tok.vocab_size})


def token_lists(tok: Tokenizer):
    """Any tokens, runs of troublesome ones, real text (multi-byte characters), or a mix."""
    any_token = st.integers(0, tok.vocab_size - 1)
    odd = st.sampled_from(troublesome(tok))
    text = st.text(alphabet=st.sampled_from("aé日本🎉 \n\t€ß✓"), max_size=30).map(tok.encode)
    piece = st.one_of(st.lists(any_token, max_size=8), st.lists(odd, max_size=40), text)
    return st.lists(piece, max_size=6).map(lambda pieces: [t for p in pieces for t in p])


def streamed(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = Detokenizer(tok)
    pieces = [d.add(t) for t in ids]
    return pieces, d.finish(ids)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_pieces_add_up_to_decode(tok, data):
    ids = data.draw(token_lists(tok))
    pieces, rest = streamed(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids)
    # Cut anywhere, the text so far is decode of the tokens so far: nothing given early
    # is taken back (a half character would be).
    k = data.draw(st.integers(0, len(ids)))
    pieces, rest = streamed(tok, ids[:k])
    assert "".join(pieces) + rest == tok.decode(ids[:k])


def test_a_character_split_over_tokens_comes_out_whole():
    tok = bundled()
    ids = tok.encode("日🎉", add_special_tokens=False)
    assert len(ids) > 2  # each character is several byte tokens
    pieces, rest = streamed(tok, ids)
    assert [p for p in pieces if p] == ["日", "🎉"] and rest == ""


def test_finish_gives_a_trailing_half_character_as_decode_does():
    tok = bundled()
    ids = tok.encode("a日", add_special_tokens=False)[:-1]  # the last byte of 日 missing
    pieces, rest = streamed(tok, ids)
    assert "".join(pieces) == "a" and rest == tok.decode(ids)[1:] and rest.endswith("\ufffd")
