"""The API's refusals in OpenAI's error body: {"error": {"message", "type", "param", "code"}} with its status."""
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def worker_failed(failure: str) -> APIError:
    return APIError(500, f"{failure}; the server is stopping: retry once it is restarted", code="worker_failed",
                    kind="server_error")
