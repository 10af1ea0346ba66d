"""A sequence's end is decided in one place, Sequence.append: end-of-text, stop strings (through the
stop checker its text stream provides), length, and min_tokens holding the first two back."""

from batching.text_stream import TextStream
from generate.sequence import SamplingParams, Sequence, Status
from model.tokenizer import EOT_ID, load_tokenizer

TOKENIZER = load_tokenizer()


def feed(seq: Sequence, tokens: list[int]) -> int:
    """Append tokens until the sequence ends; how many it took."""
    for i, token in enumerate(tokens, 1):
        seq.append(token)
        if seq.status is Status.FINISHED:
            return i
    return len(tokens)


def test_end_of_text_ends_with_stop_and_is_no_text():
    text = TextStream(TOKENIZER, ("never",))
    seq = Sequence([1], SamplingParams(max_tokens=10, stop_at_eos=True), stop=text)
    assert feed(seq, [TOKENIZER.encode(" hi")[0], EOT_ID, 5]) == 2
    assert seq.finish_reason == "stop" and text.finish() == "" and text.text == " hi"


def test_a_stop_string_ends_the_sequence_where_its_text_appears():
    text = TextStream(TOKENIZER, (" end",))
    seq = Sequence([1], SamplingParams(max_tokens=50), stop=text)
    tokens = TOKENIZER.encode("the story has an end here")
    assert feed(seq, tokens) == tokens.index(TOKENIZER.encode(" end")[0]) + 1
    assert (seq.finish_reason, text.text) == ("stop", "the story has an")


def test_length_ends_when_nothing_else_does():
    seq = Sequence([1], SamplingParams(max_tokens=3, stop_at_eos=False), stop=TextStream(TOKENIZER))
    assert feed(seq, [EOT_ID] * 5) == 3 and seq.finish_reason == "length"


def test_min_tokens_holds_back_end_of_text_and_stop_strings():
    text = TextStream(TOKENIZER, ("x",))
    seq = Sequence([1], SamplingParams(max_tokens=10, min_tokens=3, stop_at_eos=True), stop=text)
    x = TOKENIZER.encode("x")[0]
    assert feed(seq, [EOT_ID, x, x, x]) == 3 and seq.finish_reason == "stop"  # the third may stop, and does
    assert text.text == "<|endoftext|>x"  # below min_tokens, neither ended it: both are text
    seq = Sequence([1], SamplingParams(max_tokens=10, min_tokens=3, stop_at_eos=True), stop=TextStream(TOKENIZER))
    assert feed(seq, [EOT_ID] * 5) == 3 and seq.finish_reason == "stop"
