import pytest

from model.tokenizer import EOT_ID, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize(
    ("text", "ids"),
    [  # ids published for the GPT-2 vocabulary
        ("hello world", [31373, 995]),
        ("Hello world", [15496, 995]),
        (" The quick brown fox", [383, 2068, 7586, 21831]),
        ("The lighthouse keeper", [464, 46371, 28356]),
    ],
)
def test_known_gpt2_ids(tok, text, ids):
    assert tok.encode(text) == ids


def test_end_of_text_is_the_last_id(tok):
    assert tok.n_vocab == 50257
    assert tok.encode("<|endoftext|>", allowed_special="all") == [EOT_ID]


@pytest.mark.parametrize(
    "text",
    ["naïve café", "日本語のテキスト", "emoji 🦙🚀 and ZWJ 👩‍👩‍👧", "tabs\tand\nnewlines  ", "Ωμέγα ∑ ∞", ""],
)
def test_round_trips_unicode(tok, text):
    assert tok.decode(tok.encode(text)) == text
