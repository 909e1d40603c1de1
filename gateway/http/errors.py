"""OpenAI-style errors: one exception type the handlers raise, one JSON shape the client sees.

Every error body is ``{"error": {"message", "type", "param", "code"}}``; messages are bounded in length
and never carry a stack trace, whatever went wrong.
"""

from __future__ import annotations

MAX_MESSAGE_CHARS = 1000  # a client-controlled value quoted in a message cannot blow up the body

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client should see with ``status``; ``param`` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message[:MAX_MESSAGE_CHARS]
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # set only for 503: becomes the Retry-After header

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else "bad_request")


def no_capacity(retry_after_s: int, why: str = "no worker can take this request now") -> APIError:
    return APIError(
        503,
        f"service unavailable: {why}; retry after {retry_after_s} s",
        code="no_capacity",
        retry_after_s=retry_after_s,
    )
