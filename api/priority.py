"""The `priority` request field (/inference, /v1/completions, /v1/chat/completions): an integer, lower is
more urgent, 0 by default, as vLLM's. The scheduler ranks by it (generate/priority.py)."""

from api.validation import integer

PRIORITY_LIMIT = 1000  # priorities run from -1000 to 1000; Batch API requests run at 1000, the lowest


def parse_priority(body: dict) -> int:
    return integer(body, "priority", 0, -PRIORITY_LIMIT, PRIORITY_LIMIT)
