"""The error types of the HTTP layer, each rendered as ``{"error": {"code", "message"}}``.

    ApiError(status, code, message)       any error answer; the routes raise it or a subclass
    ├── InvalidRequest    400 invalid_request   malformed JSON, wrong types, bad values
    ├── Forbidden         403 forbidden         the token's tenant lacks the scope (``api/tenants.py``)
    ├── UnknownDataset    404 unknown_dataset   no dataset of that name
    ├── DatasetChanged    409 dataset_changed   the data changed in the store while it was read
    ├── Overloaded        429 overloaded        admission refused; carries Retry-After
    └── StoreUnavailable  503 store_unavailable the store failed after retries; carries Retry-After
"""

from __future__ import annotations

from starlette.responses import JSONResponse

RETRY_AFTER = {"Retry-After": "1"}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.message, self.headers)


class InvalidRequest(ApiError):
    def __init__(self, message: str):
        super().__init__(400, "invalid_request", message)


class Forbidden(ApiError):
    def __init__(self, message: str):
        super().__init__(403, "forbidden", message)


class UnknownDataset(ApiError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(404, "unknown_dataset", f"no dataset named {name[:200]!r} "
                                                 f"(datasets: {', '.join(known) or 'none'})")


class DatasetChanged(ApiError):
    def __init__(self, what: str):
        super().__init__(409, "dataset_changed", f"{what}; the dataset is being reopened at its new version: "
                                                 "send the request again", RETRY_AFTER)


class Overloaded(ApiError):
    def __init__(self, message: str):
        super().__init__(429, "overloaded", message, RETRY_AFTER)


class StoreUnavailable(ApiError):
    def __init__(self, message: str):
        super().__init__(503, "store_unavailable", message, RETRY_AFTER)


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)
