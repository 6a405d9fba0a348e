"""The HTTP side: one thin FastAPI route per endpoint calling ``SpeechServing``, one JSON error shape for every
refusal, a body-size limit, and uvicorn with a shutdown that cancels the running requests first.

    POST   /v1/audio/speech        text -> audio (wav, pcm, mp3, opus, aac, flac; whole, streamed, or as events)
    GET    /v1/audio/voices        the voices ``voice`` may name
    POST   /v1/audio/voices        multipart: audio (a WAV file, 1-30 s), name, ref_text -> a voice
    DELETE /v1/audio/voices/{name}
    GET    /v1/models              the served model
    GET    /v1/models/{model}      its card (404 for another name)
    GET    /health                 200 while the server takes requests (HEAD too)
"""

from __future__ import annotations

import contextvars
import logging
import socket
from typing import Annotated

import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .. import __version__
from .encoding import MEDIA_TYPES
from .protocol import APIError, ErrorResponse, ModelCard, ModelList, SpeechRequest, VoiceCard, VoiceList
from .serving import ClientGone, SpeechServing, StreamCut

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 408, 409, 413, 500, 503)}


def build_app(serving: SpeechServing) -> FastAPI:
    """The ASGI app of the speech server around ``serving``."""
    app = FastAPI(title="higgs-talker", version=__version__, responses=_ERRORS)
    app.state.serving = serving
    app.add_middleware(BodyLimit, max_bytes=serving.config.max_body_bytes)
    app.add_middleware(CutStreams)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return _error(APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", "body"))
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or "body"
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if param == "body" and kind != "application/json" and not kind.endswith("+json"):
            # FastAPI parses JSON only under a JSON type: curl -d without -H sends a form type, and
            # requests.post(data=...) none, which FastAPI >= 0.132 no longer reads as JSON (strict_content_type)
            return _error(APIError(400, "the body must be JSON, sent as Content-Type: application/json "
                                   f"({f'got {kind}' if kind else 'none was given'})", "body"))  # fmt: skip
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")  # a validator's own words
        return _error(APIError(400, f"{param}: {message}", param))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:  # a bug: still the one JSON shape
        return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        cause = exc.__cause__  # FastAPI's 400 "There was an error parsing the body" says neither what nor where
        if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
            return _error(APIError(400, f"the body is not valid JSON: it is not UTF-8 text ({cause})", "body"))
        if exc.status_code == 400 and isinstance(cause, RecursionError):
            return _error(APIError(400, "the body is not valid JSON here: it nests too deeply", "body"))
        return _error(APIError(exc.status_code, str(exc.detail)), exc.headers)  # a 405's Allow among them

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers' probes often send HEAD
    async def health(request: Request) -> Response:
        if serving.closing:
            raise APIError(503, "the server is shutting down")
        return JSONResponse({"status": "ok", "active_requests": serving.active_requests, **serving.counts})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return serving.models()

    @app.get("/v1/models/{model:path}")  # :path: a served name may hold a '/' (org/name)
    async def model(model: str) -> ModelCard:
        return serving.model(model)

    @app.get("/v1/audio/voices")
    async def list_voices() -> VoiceList:
        return serving.voice_list()

    @app.post("/v1/audio/voices")
    async def add_voice(
        audio: Annotated[UploadFile, File(description="a WAV recording of the voice, 1-30 s")],
        name: Annotated[str, Form(description="the name ``voice`` will use")],
        ref_text: Annotated[str | None, Form(description="what the recording says (recommended)")] = None,
    ) -> VoiceCard:
        return await serving.add_voice(name, await audio.read(), ref_text)

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str) -> Response:
        serving.delete_voice(name)
        return JSONResponse({"deleted": name})

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, request: Request) -> Response:
        job = await serving.prepare(body)
        try:
            result = await serving.run(job, lambda: _disconnect(request))
        except ClientGone:
            logger.info("%s: the client left before the first byte; cancelled", job.id)
            return Response(status_code=499)  # nobody reads it
        media = "text/event-stream" if job.mode == "sse" else MEDIA_TYPES[job.format]
        if isinstance(result, bytes):
            return Response(result, media_type=media)
        return StreamingResponse(result, media_type=media, headers={"Cache-Control": "no-cache"})

    return app


def _error(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body().model_dump(), status_code=exc.status, headers=headers)


async def _disconnect(request: Request) -> None:
    """Returns once the client has closed the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


_cut = contextvars.ContextVar("higgs_talker_stream_cut", default=False)


class CutStreams:
    """Ends a streamed response that raised ``StreamCut`` (a failure, timeout or shutdown after its first byte) by
    returning without its last chunk: uvicorn then closes the connection and the client sees an incomplete body.
    One log line says why; uvicorn's own error line for it is dropped (``_QuietCuts``), and no traceback is logged,
    since nothing is wrong with the server."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except StreamCut as exc:
            logger.info("%s", exc)
            _cut.set(True)  # seen by _QuietCuts: uvicorn logs in this request's task, right after this returns


class _QuietCuts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_cut.get() and record.msg == "ASGI callable returned without completing response.")


_quiet_cuts = _QuietCuts()


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` with 413 (by Content-Length, or while they are read)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length")
        too_large = APIError(
            413, f"the request body is larger than this server's limit of {self.max_bytes} bytes", "body"
        )
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _error(too_large)(scope, receive, send)
        seen, started, exceeded = 0, False, False

        async def counted_receive():
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    return {"type": "http.disconnect"}  # the app stops reading; its answer is dropped below
            return message

        async def tracked_send(message):
            nonlocal started
            if exceeded:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded and not started:
            await _error(too_large)(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn's server, which cancels the running requests as soon as it is told to stop (Ctrl-C, SIGTERM), so
    that open streams end at the next engine step instead of holding the shutdown."""

    def __init__(self, config: uvicorn.Config, serving: SpeechServing) -> None:
        super().__init__(config)
        self.serving = serving

    def handle_exit(self, sig, frame) -> None:
        self.serving.shutdown()
        super().handle_exit(sig, frame)


def make_server(
    serving: SpeechServing, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", graceful_s: float = 10.0
) -> tuple[uvicorn.Server, socket.socket]:
    """A uvicorn server for ``serving`` and its listening socket (``port=0``: any free port; read it from the
    socket). ``server.run(sockets=[sock])`` serves until Ctrl-C / SIGTERM or ``server.should_exit = True``."""
    config = uvicorn.Config(
        build_app(serving),
        log_level=log_level,
        timeout_graceful_shutdown=graceful_s,
        lifespan="off",
        access_log=log_level == "debug",
    )
    logging.getLogger("uvicorn.error").addFilter(_quiet_cuts)  # after uvicorn.Config set its logging up; once
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections of a socket whose proto
    # says TCP, and with Nagle on, a streamed body's first chunk waited for the client's delayed ACK of the
    # headers (40 ms more to the first audio byte, measured on loopback)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return _Server(config, serving), sock
