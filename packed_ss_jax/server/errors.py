"""The server's errors as clients see them: an `APIError` becomes an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` whose `param` names the request field at
fault, and whose message holds none of the server's paths."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi.exceptions import RequestValidationError

from .http_guard import shutting_down
from ..api import InputError


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers or {}


def draining() -> APIError:
    """The 503 of a server that is shutting down (the same body as http_guard's)."""
    e = shutting_down()["error"]
    return APIError(503, e["message"], e["type"], code=e["code"])


def failure(e: Exception) -> APIError:
    """What a request that failed in the preparer or the decoder tells its client."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InputError):
        return APIError(400, str(e))
    return APIError(500, f"decoding failed: {type(e).__name__}: {e}", "server_error")


def invalid(e: RequestValidationError) -> APIError:
    """A body that is not JSON, or not the endpoint's request, as a 400 naming the field."""
    errors = e.errors()
    # A union (a stop string or a list of them) fails once per member: the error our own
    # checks raised says more than "should be a valid string".
    first = next((x for x in errors if x.get("type") == "value_error"),
                 errors[0] if errors else {})
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}")
    loc = _field_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return APIError(400, f"{'.'.join(loc) or 'body'}: {message}",
                    param=loc[0].split("[")[0] if loc else None)


def _field_path(loc) -> list[str]:
    """A validation error's place as the request's field names and list indices, without
    pydantic's own steps (union members such as 'str' or 'function-after[...]')."""
    path = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, int) and path:
            path[-1] += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier() and x not in _TYPE_NAMES:
            path.append(x)
    return path


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict"})


class Scrubber:
    """Error messages without the server's paths: the model's directory becomes the
    served model's name, the package's and Python's install directories disappear."""

    def __init__(self, model, name: str):
        installed = Path(__file__).resolve().parents[2]  # the folder holding the package
        self.paths = [(str(Path(model.source).resolve()), name)] if model.source else []
        self.paths += [(str(installed), "."), (str(Path(os.__file__).parent), ".")]
        self.paths.sort(key=lambda pair: -len(pair[0]))

    def __call__(self, text: str) -> str:
        for path, short in self.paths:
            text = text.replace(path, short)
        return text
