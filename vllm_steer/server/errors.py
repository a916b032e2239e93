"""The error body of every steer route, in vLLM's OpenAI error format."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_response(status: int, message: str, type_: str = "BadRequestError",
                   param: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": status}}, status_code=status)


#: The error ``type`` of each HTTP status a steer route answers with (vLLM's names where it
#: has one; any other 4xx: ``BadRequestError``).
ERROR_TYPES = {403: "PermissionError", 404: "NotFoundError", 409: "ConflictError",
               429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError", 507: "InsufficientStorageError"}


def error_type(status: int) -> str:
    """The error ``type`` of HTTP ``status`` (:data:`ERROR_TYPES`)."""
    return ERROR_TYPES.get(int(status), "BadRequestError")
