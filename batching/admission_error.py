"""A request refused at admission: why (a reason counted in /stats and /metrics), its status and Retry-After."""

import math


class Refused(Exception):
    def __init__(self, reason: str, message: str, status: int, retry_after_s: float):
        super().__init__(message)
        self.reason, self.status = reason, status
        self.retry_after = max(1, math.ceil(retry_after_s))  # Retry-After is whole seconds
