"""The error body of every steer route, in vLLM's OpenAI error format."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_response(status: int, message: str, type_: str = "BadRequestError",
                   param: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": status}}, status_code=status)
