"""Strict JSON request bodies: every malformed body is a 400 that says what is wrong, never a 500.

Python's json module lets a duplicate key silently replace the first, and raises
RecursionError, not a ValueError, on deep nesting, which Flask would answer with a 500. The
app's JSON provider parses with these holes closed, so every endpoint that calls
`request.get_json` is covered. NaN, Infinity and numbers that overflow to infinity (1e999)
parse to floats on purpose: every numeric field's check refuses them, naming the field.
"""

import json
from typing import Any

from flask.json.provider import DefaultJSONProvider

from api.errors import ApiError, bad


class StrictJSONProvider(DefaultJSONProvider):
    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        return parse_json(s)


def parse_json(body: str | bytes) -> Any:
    if isinstance(body, bytes):
        try:
            body = body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise bad(f"the request body is not valid UTF-8 (byte {err.start})") from None
    try:
        return json.loads(body, object_pairs_hook=_object)
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except json.JSONDecodeError as err:
        raise bad(f"the request body is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise bad(f"the request body has a value out of range: {err}") from None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ApiError(400, f"duplicate key {key!r} in the request body", param=key)
        obj[key] = value
    return obj


def require_json(is_json: bool, content_type: str | None) -> None:
    """A POST body must say it is JSON: a form or text body parsed as JSON would be a guess."""
    if not is_json:
        raise ApiError(
            415,
            f"send the request body as JSON with 'Content-Type: application/json' (got {content_type or 'none'!r})",
            param="Content-Type",
        )
