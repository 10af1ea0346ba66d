"""Request validation shared by the endpoints: every problem is a 4xx naming its field."""

import math
from collections.abc import Collection
from typing import Any


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers or {}
        self.code = code  # OpenAI's machine-readable code (e.g. model_not_found); the status when none

    def body(self) -> dict:
        code = self.code or self.status
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def json_object(body: Any) -> dict:
    """The body's fields; a null field counts as absent, as OpenAI's clients send it for "not given"."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return {name: value for name, value in body.items() if value is not None}


def known_fields(body: dict, allowed: Collection[str], where: str) -> None:
    """Refuse a field this endpoint does not know: a request is never answered as if it had not asked."""
    for name in body:
        if name not in allowed:
            raise bad(f"unknown or unsupported field '{name}' for {where}", name)


def integer(body: dict, name: str, default: Any, low: int, high: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number, got {value!r}", name)
    if not low <= value <= high:
        raise bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {value!r}", name)
    return value


def optional_seed(body: dict) -> int | None:
    return None if body.get("seed") is None else integer(body, "seed", None, 0, 2**63 - 1)
