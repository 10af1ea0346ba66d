"""The one error every endpoint answers with: a JSON 4xx (or 5xx) in OpenAI's and vLLM's shape, naming the field."""


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
