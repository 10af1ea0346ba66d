"""GPT-2 BPE tokenizer that works offline.

`tiktoken.get_encoding("gpt2")` downloads its vocabulary on first use, which fails on
offline machines, so the same ranks ship next to this file (from openai-whisper's
`whisper/assets/gpt2.tiktoken`, MIT licence) and are checked by hash on load.
"""

from pathlib import Path

import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str

VOCAB_FILE = Path(__file__).with_name("gpt2.tiktoken")
VOCAB_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256


def load_tokenizer() -> tiktoken.Encoding:
    ranks = tiktoken.load.load_tiktoken_bpe(str(VOCAB_FILE), expected_hash=VOCAB_SHA256)
    assert len(ranks) == EOT_ID, f"expected {EOT_ID} BPE ranks, got {len(ranks)}"
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOT_TOKEN: EOT_ID},
    )


def encode_prompt(tokenizer: tiktoken.Encoding, text: str) -> list[int]:
    """A text prompt's tokens, where `<|endoftext|>` is the end-of-text token (as in OpenAI's completions
    API, whose default prompt it is, and Hugging Face's GPT-2 tokenizer): documents joined by it read as
    they were trained. Chat message content is not a prompt: there it is text, as in OpenAI's chat API."""
    return tokenizer.encode(text, allowed_special={EOT_TOKEN}, disallowed_special=())
