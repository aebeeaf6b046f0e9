"""The HTTP routes of the OpenAI server (k3.infer.server) and its error handlers. Each route parses its body into
a k3.infer.protocol model, calls the app's :class:`k3.infer.serving.Serving` (``app.state.serving``) and returns
what it answers; every refusal goes out as OpenAI's error body with one message."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.infer.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_response,
)
from k3.infer.serving import Serving

router = APIRouter()


def serving(request: Request) -> Serving:
    return request.app.state.serving


@router.get("/health")
async def health(request: Request):
    return serving(request).health()


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [serving(request).model_card()]}


@router.get("/v1/models/{name:path}")
async def model(name: str, request: Request):
    return serving(request).model(name)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    return await serving(request).completions(req, request)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, request: Request):
    return await serving(request).chat_completions(req, request)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    return serving(request).tokenizer_info()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    return await serving(request).tokenize(req)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    return await serving(request).detokenize(req)


async def invalid_request(request: Request, exc: RequestValidationError):
    """A body pydantic refused: 400 naming the first bad field (``messages.0.content: ...``) or bad JSON."""
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {err.get('msg')}")
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return error_response(400, f"{param}: {msg}" if param else msg, param)


async def http_error(request: Request, exc: StarletteHTTPException):
    return error_response(
        exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404 else "invalid_request_error"
    )


async def api_error(request: Request, exc: APIError):
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.kind)


def install(app: FastAPI) -> None:
    """The routes and error handlers on ``app`` (whose ``state.serving`` answers them)."""
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(APIError, api_error)
    app.include_router(router)
