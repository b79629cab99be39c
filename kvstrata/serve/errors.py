"""Errors as OpenAI's API returns them: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause ends here with a 4xx; nothing it sends reaches the client as a
traceback or a 500.
"""

from __future__ import annotations

#: OpenAI's error `type` for each status this server answers with
TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "timeout_error",
}


class APIError(Exception):
    """A request that is answered with an error object instead of a result."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
