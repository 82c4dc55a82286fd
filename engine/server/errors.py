"""The server's error type and the OpenAI-style error body every error answer carries."""
from __future__ import annotations

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
          408: "RequestTimeoutError", 413: "RequestTooLargeError", 422: "BadRequestError",
          431: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An answer other than 200, raised anywhere in request handling and rendered by the app."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its engine requests were aborted."""


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`, as OpenAI and vLLM answer."""
    return {"error": {"message": message, "type": err_type or _TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}
