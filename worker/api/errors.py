"""Every error the API answers is an OpenAI error body, `{"error": {...}}`, with a status
that says whose fault it is: 4xx the request's, 5xx ours."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from preload.worker.api.protocol import error_body
from preload.worker.engine.sampling_params import RequestError


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, status, param), status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error_response(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestError)  # a parameter out of range, a prompt the engine cannot take
    async def _request_error(_, e: RequestError):
        return error_response(400, str(e), param=e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        errors = e.errors()
        # Our own reason (a model validator's ValueError) over what the other branches of a
        # union say: an image part is refused as such, not as "not a string".
        first = next((err for err in errors if err.get("type") == "value_error"), errors[0])
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = first.get("msg", "invalid request").removeprefix("Value error, ")  # (pydantic's, before ours)
        return error_response(400, f"{where}: {message}" if where else message,
                              param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail),
                              "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")
