"""The HTTP API's routes, error handling, auth and body limit, as one ASGI app.

Errors leave in the shape of the API the path belongs to: Anthropic's under
/v1/messages, OpenAI's everywhere else. A body that fails validation is a 400 whose
`param` names the first bad field (FastAPI's default would be a 422 in its own shape).
With --api-key-file every /v1/ route needs `Authorization: Bearer <key>` or
`x-api-key: <key>` (what the Anthropic SDK sends) with one of the file's keys;
/health and /metrics stay open, like the gRPC health service. A gateway in front of
several schedulers reads /health, /v1/models, /v1/loads and /metrics (load_report).
"""

from __future__ import annotations

import structlog
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from scheduler_svc.api_keys import api_key_interceptor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.http_api import anthropic_messages, openai_chat, openai_completions, openai_responses
from scheduler_svc.http_api.anthropic_schema import CountTokensRequest, MessagesRequest
from scheduler_svc.http_api.body_limit import BodyLimit
from scheduler_svc.http_api.errors import ApiError
from scheduler_svc.http_api.front import Front
from scheduler_svc.http_api.generation import ClientGone
from scheduler_svc.http_api.openai_schema import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from scheduler_svc.load_report import Load, smg_loads
from scheduler_svc.refusals import log_refusal
from scheduler_svc.step_loop import StepLoop

log = structlog.get_logger()

ANTHROPIC_PREFIX = "/v1/messages"


def error_body(path: str, error: ApiError) -> dict:
    return error.anthropic_body() if path.startswith(ANTHROPIC_PREFIX) else error.openai_body()


def error_response(path: str, error: ApiError) -> JSONResponse:
    return JSONResponse(refusal_body(path, error), status_code=error.status)


def refusal_body(path: str, error: ApiError) -> dict:
    """error_body, and the refusal's one log line (scheduler_svc/refusals.py) for an API request
    (under /v1/: Claude Code's probe of `/` is no request); a 500 is a bug, logged with its
    traceback where it is caught instead."""
    if error.status != 500 and path.startswith("/v1/"):
        log_refusal(path, error.status, error.param, error.message)
    return error_body(path, error)


def _field_path(loc: tuple) -> str:
    """("body", "messages", 0, "role") → "messages[0].role"."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def validation_error(exc: RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    field = _field_path(tuple(first.get("loc", ())))
    if not field:
        return ApiError(400, f"the body must be a JSON object: {first.get('msg')}")
    return ApiError(400, f"{field}: {first.get('msg')}", field)


class ApiKeys:
    """--api-key-file's keys, checked against either header."""

    def __init__(self, path: str) -> None:
        self._interceptor = api_key_interceptor(path)  # its constant-time comparison

    def is_authorized(self, request: HttpRequest) -> bool:
        bearer = request.headers.get("authorization", "")
        if not bearer and request.headers.get("x-api-key"):
            bearer = "Bearer " + request.headers["x-api-key"]
        return self._interceptor.is_authorized([("authorization", bearer)])


def build_app(config: SchedulerConfig, loop: StepLoop, metrics=None) -> FastAPI:
    front = Front(config, loop, metrics)
    app = FastAPI(title="swarmserve", version="1", docs_url=None, redoc_url=None)
    keys = ApiKeys(config.api_key_file) if config.api_key_file else None

    @app.middleware("http")
    async def require_key(request: HttpRequest, call_next):
        if keys is not None and request.url.path.startswith("/v1/") and not keys.is_authorized(request):
            return error_response(
                request.url.path,
                ApiError(
                    401,
                    "missing or unknown API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' "
                    "with a key from the scheduler's --api-key-file",
                ),
            )
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def on_api_error(request: HttpRequest, exc: ApiError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: HttpRequest, exc: RequestValidationError):
        return error_response(request.url.path, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: HttpRequest, exc: HTTPException):
        return error_response(request.url.path, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: HttpRequest, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it; the requests were released

    @app.exception_handler(Exception)
    async def on_bug(request: HttpRequest, exc: Exception):
        log.exception("http_handler_failed", path=request.url.path)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health():
        """200 while the scheduler takes requests (executor attached, not draining), else 503."""
        if loop.is_serving:
            return {"status": "ok"}
        return JSONResponse(
            {"status": "unavailable", "reason": loop.stopped_reason or loop.last_connect_error or "not serving"}, 503
        )

    @app.get("/metrics")
    async def prometheus_metrics():
        if metrics is None:
            raise ApiError(404, "metrics are off")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/loads")
    async def loads():
        """SMG's load report (load_report.smg_loads), which it polls for its load-aware routing."""
        if not loop.is_connected:
            raise ApiError(503, f"the executor at {config.executor} is not connected; no load to report")
        return smg_loads(Load.of(loop.view))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(front)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != front.model_name:
            raise ApiError(404, f"no model {model_id!r}; this server serves {front.model_name!r}", "model")
        return _model_card(front)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: HttpRequest):
        return await openai_chat.chat_completions(front, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HttpRequest):
        return await openai_completions.completions(front, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: HttpRequest):
        return await openai_responses.responses(front, body, request)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: HttpRequest):
        return await anthropic_messages.messages(front, body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        return await anthropic_messages.count_tokens(front, body)

    app.add_middleware(BodyLimit, max_bytes=config.max_message_bytes, error_body=refusal_body)
    return app


def _model_card(front: Front) -> dict:
    info = front.loop.view.info
    card = {"id": front.model_name, "object": "model", "created": 0, "owned_by": "swarmserve"}
    if info is not None:
        card["context_length"] = info.context_length
        if info.model_title:
            card["name"] = info.model_title  # the GGUF's own name (general.name), spaces and all
    return card
