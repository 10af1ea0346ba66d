"""The fenced code blocks of a Markdown file, for tests that run what the documentation shows."""

import re
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def block_with(path: Path, needle: str, offset: int = 0) -> str:
    """The block containing `needle` (or the one `offset` blocks after it)."""
    blocks = code_blocks(path)
    found = [i for i, (_, text) in enumerate(blocks) if needle in text]
    assert len(found) == 1, f"{path.name}: {len(found)} blocks contain {needle!r}"
    return blocks[found[0] + offset][1]
