"""Incremental detokenisation: whole characters only, stop strings cut out and never emitted."""

import pytest

from batching.text_stream import TextStream
from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()


def stream(text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    s = TextStream(TOKENIZER, stop)
    pieces = [s.push(t) for t in TOKENIZER.encode(text)]
    return [*pieces, s.finish()], s


def test_characters_split_across_tokens_are_emitted_whole():
    text = "日本語 🦙🚀 ok"
    ids = TOKENIZER.encode(text)
    # The premise: some of these tokens are not valid UTF-8 on their own.
    assert any(not _valid(TOKENIZER.decode_single_token_bytes(t)) for t in ids)
    pieces, _ = stream(text)
    assert "".join(pieces) == text
    assert all(_valid(p.encode()) and "\ufffd" not in p for p in pieces)


def test_tokens_pushed_together_release_what_they_release_one_by_one():
    ids = TOKENIZER.encode("日本語 🦙🚀 ok")
    cut = next(i for i, t in enumerate(ids) if not _valid(TOKENIZER.decode_single_token_bytes(t))) + 1
    together = TextStream(TOKENIZER)
    first = together.push_many(ids[:cut])  # ends inside a character: held until its last byte comes
    assert "\ufffd" not in first and first == TOKENIZER.decode(ids[:cut]).rstrip("\ufffd")
    assert first + together.push_many(ids[cut:]) + together.finish() == together.text == "日本語 🦙🚀 ok"


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello world. STOP and more", ("STOP",), "Hello world. "),
        ("one, two, three", ("three", ", t"), "one"),  # the earliest stop wins
        ("no stop here", ("xyz",), "no stop here"),
        ("ends with a partial ST", ("STOP",), "ends with a partial ST"),  # held back, then released
    ],
)
def test_stop_strings(text, stops, expected):
    pieces, s = stream(text, stops)
    assert "".join(pieces) == s.text == expected
    assert s.stopped == (expected != text)


def test_text_that_may_start_a_stop_string_is_held_back():
    s = TextStream(TOKENIZER, ("</end>",))
    released = "".join(s.push(t) for t in TOKENIZER.encode("answer </"))
    assert released == "answer "  # "</" could still become "</end>"
    assert "".join(s.push(t) for t in TOKENIZER.encode("end>")) == "" and s.stopped


def test_take_hands_out_each_released_piece_once():
    s = TextStream(TOKENIZER)
    for t in TOKENIZER.encode("one two"):
        s.push(t)
    assert s.take() == "one two" and s.take() == ""
    s.push(TOKENIZER.encode(" three")[0])
    assert s.take() == " three"


def test_stop_strings_are_not_looked_for_while_stopping_is_not_allowed():
    s = TextStream(TOKENIZER, ("STOP",))
    ids = TOKENIZER.encode("a STOP b STOP c")  # a, " STOP", " b", " STOP", " c"
    stopped = [s.stops_at(t, may_stop=i >= 2) for i, t in enumerate(ids)]  # min_tokens 2
    assert stopped.index(True) == 3  # the second STOP, not the first
    assert s.text == "a STOP b "


def test_random_texts_and_overlapping_stop_strings_match_a_plain_search():
    """Against a plain search (after each token, the text up to the earliest stop string found in all of it so
    far), on texts and stop strings of two letters, where stop strings overlap themselves and each other; the
    text released after each token is always a prefix of the answer, and never holds back a whole stop string."""
    import random

    rng = random.Random(7)
    ids = {c: TOKENIZER.encode(c) for c in ("a", "b", "ab", "ba", "aa", "abb", "aba")}
    assert all(len(i) == 1 for i in ids.values())  # a piece is a token: the search looks after each
    for _ in range(300):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        pieces = [rng.choice(list(ids)) for _ in range(rng.randint(1, 12))]
        text, found = "".join(pieces), []
        for end in range(1, len(pieces) + 1):
            so_far = "".join(pieces[:end])
            if found := [i for i in (so_far.find(stop) for stop in stops) if i >= 0]:
                break
        expected = text[: min(found)] if found else text
        s = TextStream(TOKENIZER, stops)
        for n, piece in enumerate(pieces, 1):
            for t in ids[piece]:
                s.push(t)
            assert expected.startswith(s.text), (text, stops)
            if not s.stopped:
                assert len("".join(pieces[:n])) - len(s.text) < max(map(len, stops))
        s.finish()
        assert s.text == expected and s.stopped == bool(found), (text, stops)
