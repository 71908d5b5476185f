"""The HTTP face of a served model: a Starlette app (`create_app`) speaking OpenAI's completions API.

    GET  /v1/models        the base and every LoRA adapter served beside it, in OpenAI's list
                           shape (an adapter's `parent` is the base, as vLLM lists them)
    POST /v1/completions   OpenAI's legacy completions (`stream` is server-sent events ending in
                           `data: [DONE]`); `top_k` and `attention` (the attention weights of
                           chosen layers and heads at every token) are eqx_gpt's extensions
    POST /v1/inspect       eqx_gpt's own: attention of a layer's heads, next-token top 10 before and
                           after the filters, the logit lens (`eqx_gpt.serve.inspect`)
    GET  /v1/card          eqx_gpt's own: the model card (`eqx_gpt.serve.card`)
    GET  /v1/run           eqx_gpt's own: the step served and the run's losses so far, and whether
                           the server follows the run (`--follow`: `eqx_gpt.serve.follow`)
    GET  /health           200 `{"status": "ok"}` while serving; 503 once draining (llama.cpp's)
    GET  /metrics          Prometheus's text format (`eqx_gpt.serve.metrics`)
    POST /tokenize         llama.cpp's: `content` (or vLLM's `prompt`) -> `tokens`, with their
                           pieces if `with_pieces`
    POST /detokenize       llama.cpp's: `tokens` -> `content`
    GET  /                 the page (`page/`: HTML, CSS and JS, no build step, nothing fetched)

A request's `model` picks the base or one of its adapters (`create_app(adapters=...)`); requests
for different adapters decode in the same steps (`stack_adapters`: each slot applies its own).
Requests are decoded together by one `Batcher` (its thread starts and stops with the app). The
ASGI side hands it `Sequence`s and reads their tokens from an `asyncio.Queue` that the batcher's
thread fills through `loop.call_soon_threadsafe`. A client that disconnects cancels its sequences,
which free their slots at the batcher's next step. Every error is OpenAI's JSON,
`{"error": {"message", "type", "param", "code"}}`, with a 4xx status for a bad request (naming the
field), 429 with `Retry-After` when the queue is full, and the server keeps serving.

What a page on another site, or a client that means harm, could do is refused before any work:
a `Host` not among `allowed_hosts` (DNS rebinding: Starlette's `TrustedHostMiddleware`), a body
that is not `application/json` (415: a cross-site form or `text/plain` POST needs no preflight),
a body over `max_body_bytes` (413, from its `Content-Length` or its running count, before it is
held), a missing or wrong `Authorization: Bearer` key when `api_key` is set (401), a request past
`drain` (503). `drain` (called on SIGTERM by `eqx_gpt.serve.http_server`) ends every completion
still running after its grace with a final event: an error event then `[DONE]`, or a 503.
"""

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, SimpleUser
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from eqx_gpt._checks import SEED_MAX
from eqx_gpt.errors import EqxGptError, TokenizerError
from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.sampling import SamplingOptions
from eqx_gpt.model.multi_lora import choose_adapter, stack_adapters
from eqx_gpt.serve.batcher import Batcher, Failed, Finished, QueueFull, Sequence, Token, sample_key_data
from eqx_gpt.serve.card import model_card, run_losses
from eqx_gpt.serve.completions import ChoiceText, token_pieces
from eqx_gpt.serve.follow import FOLLOW_EVERY_S, RunFollower
from eqx_gpt.serve.inspect import attention_layout, inspect_text
from eqx_gpt.serve.lens import lens_layout
from eqx_gpt.serve.metrics import ServerMetrics
from eqx_gpt.serve.requests import (
    BIAS_LIMIT,
    CompletionRequest,
    RequestError,
    load_body,
    parse_completion,
    parse_detokenize,
    parse_inspect,
    parse_tokenize,
)

PAGE = Path(__file__).resolve().parent / "page"
RETRY_AFTER_S = 1
MAX_BODY_BYTES = 1 << 20  # a request's body: a prompt of 1 MiB is 250,000 GPT-2 tokens, far past any context
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the names of this machine, for `allowed_hosts`
PUBLIC_PATHS = ("/", "/health")  # answered without the API key (and /page/, the page's files)
INSPECTING_MAX = 2  # /v1/inspect forward passes at once (each outside the batch, on the same cores)
NOT_ADMITTING = "the server is shutting down and admits no more requests; retry on another server"
SHUTTING_DOWN = "the server is shutting down; this completion ended before its last token"


def error_response(
    message: str,
    status: int,
    *,
    param: str | None = None,
    code: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict | None = None,
) -> JSONResponse:
    """OpenAI's error JSON with `status`. A lone surrogate quoted from a request is written as its
    escape (it cannot be UTF-8)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    param = None if param is None else param.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


END = -1  # the index of the event that ends a reply (`Server.drain`)


class Cut(EqxGptError):
    """A completion ended before its last token: a failed step (`status` 500) or a drain (503).
    Caught inside the server, where it becomes the reply's last event; an `EqxGptError` as every
    exception of the package is."""

    def __init__(self, message: str, status: int, code: str | None):
        super().__init__(message)
        self.status, self.code = status, code


def _too_large(limit: int) -> RequestError:
    return RequestError(
        f"the request body is over this server's {limit} bytes; send a smaller one (or start the server "
        f"with a larger --max-body-bytes)", status=413, code="request_too_large",
    )  # fmt: skip


@dataclass(eq=False)
class Choice:
    """One choice of a request in flight: its sequence and its text."""

    index: int
    sequence: Sequence | None  # None: nothing to draw (max_tokens 0)
    text: ChoiceText
    prompt: list[int]
    discard_first: bool = False  # drawn only for the prompt's log-probabilities (max_tokens 0)
    tokens: int = 0
    echoed: bool = False
    done: bool = False
    last_token: float | None = None  # when its latest token came (time.monotonic())


class Server:
    """The app's state: the model, its tokenizer and name, its adapters' names, the batcher decoding
    for them all, and the replies in flight (for `drain`)."""

    def __init__(self, model: Decoder, tokenizer, meta: dict, name: str, *, slots: int, queue_size: int,
                 max_tokens_limit: int, keep: int | None, max_body_bytes: int,
                 adapters: abc.Mapping[str, Any] | None = None):  # fmt: skip
        self.model, self.tokenizer, self.meta, self.name = model, tokenizer, meta, name
        self.max_tokens_limit, self.max_body_bytes = max_tokens_limit, max_body_bytes
        self.adapters = list(adapters or {})  # adapter i + 1 of `served`
        # The base with every adapter stacked beside it (itself when there are none): what decodes.
        self.served = stack_adapters(model, list((adapters or {}).values()), self.adapters)
        self.batcher = Batcher(self.served, slots=slots, queue_size=queue_size, keep=keep)
        self.layout = attention_layout(model)  # the page's attention layers, found by type
        self.lens = lens_layout(model)  # the logit lens's blocks, found by type
        self.follower: RunFollower | None = None  # `--follow`: the run's newest checkpoint swapped in
        self.created = int(time.time())
        self.replies: set[Reply] = set()
        self.draining = False
        self.inspecting = 0  # /v1/inspect passes running
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's, once it has started
        self.metrics = ServerMetrics(self.batcher, lambda: len(self.replies))

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """The app's life: the batcher's thread, and the follower's (`--follow`), run while it serves."""
        self.loop = asyncio.get_running_loop()
        self.batcher.start()
        if self.follower is not None:
            self.follower.start()
        try:
            yield
        finally:
            if self.follower is not None:
                self.follower.stop()
            self.batcher.stop()

    def swap(self, model: Decoder, meta: dict) -> None:
        """Serve `model` (the served model's structure, new weights; `meta` its checkpoint's) from
        now on: the page's passes at once, the batcher from its next step (`Batcher.swap`). A
        server with adapters follows no run (`create_app`)."""
        self.batcher.swap(model)
        self.model = self.served = model
        self.meta = meta

    def drain(self, grace_s: float) -> None:
        """Admit no more requests (503) and end every completion still running `grace_s` seconds
        from now, each with a final event. Safe to call from any thread or a signal handler;
        a second call can only bring the end closer."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain, grace_s)

    def _drain(self, grace_s: float) -> None:
        self.draining = True
        assert self.loop is not None
        self.loop.call_later(max(grace_s, 0.0), self._end_replies)

    def _end_replies(self) -> None:
        for reply in list(self.replies):
            reply.ending = True  # seen before the tokens already queued for it
            reply.queue.put_nowait((END, None))  # wakes it if it waits

    async def read_json(self, request: Request):
        """The request's JSON body, refused before any work when the server drains (503), when it
        is not `application/json` (415) or when it is over `max_body_bytes` (413, before it is held)."""
        if self.draining:
            raise RequestError(NOT_ADMITTING, status=503, code="server_shutting_down")
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise RequestError(
                f"the body must be JSON sent with 'Content-Type: application/json', got "
                f"{media or 'no content type'!r}", status=415, code="unsupported_media_type",
            )  # fmt: skip
        declared = request.headers.get("content-length", "")
        if len(declared) > 20 or (declared.isdigit() and int(declared) > self.max_body_bytes):
            raise _too_large(self.max_body_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
        return await run_in_threadpool(load_body, b"".join(chunks))  # a megabyte of JSON: off the loop

    async def health(self, request: Request) -> Response:
        if self.draining:
            return error_response("the server is shutting down", 503, kind="unavailable_error",
                                   code="server_shutting_down")  # fmt: skip
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=self.metrics.content_type)

    async def tokenize(self, request: Request) -> Response:
        text, with_pieces = parse_tokenize(await self.read_json(request))
        ids = await run_in_threadpool(_encode, self.tokenizer, text)
        tokens = token_pieces(self.tokenizer, ids) if with_pieces else ids
        return JSONResponse({"tokens": tokens, "count": len(ids),
                             "max_model_len": self.model.context_length})  # fmt: skip

    async def detokenize(self, request: Request) -> Response:
        ids = parse_detokenize(await self.read_json(request), self.model.vocab_size)
        return JSONResponse({"content": await run_in_threadpool(self.tokenizer.decode, ids)})

    async def models(self, request: Request) -> Response:
        model = {"id": self.name, "object": "model", "created": self.created, "owned_by": "eqx_gpt"}
        adapters = [{**model, "id": name, "parent": self.name} for name in self.adapters]
        return JSONResponse({"object": "list", "data": [model, *adapters]})

    async def card(self, request: Request) -> Response:
        return JSONResponse(
            await run_in_threadpool(model_card, self.model, self.meta, self.name, self.layout, self.adapters)
        )

    async def run(self, request: Request) -> Response:
        """The step served and the run's losses so far: what the page polls while it follows a run."""
        follower, meta = self.follower, self.meta
        answer = {
            "step": meta.get("step"),
            "checkpoint": Path(meta["path"]).name if "path" in meta else None,
            "following": follower is not None,
            "loaded": 0 if follower is None else follower.loaded,
            "error": None if follower is None else follower.error,
        }
        return JSONResponse({**answer, **await run_in_threadpool(run_losses, meta)})

    async def inspect(self, request: Request) -> Response:
        """A forward pass outside the batch: at most `INSPECTING_MAX` at once, beyond 429, so a flood
        of them cannot starve the decode loop."""
        body = await self.read_json(request)
        parse = lambda: parse_inspect(
            body, self.layout, self.model.context_length, self.tokenizer, [self.name, *self.adapters]
        )
        args = await run_in_threadpool(parse)
        if self.inspecting >= INSPECTING_MAX:
            self.metrics.rejected.labels("inspect_busy").inc()
            return error_response(
                f"{self.inspecting} inspections are running (at most {INSPECTING_MAX}); retry shortly", 429,
                code="inspect_busy", kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        self.inspecting += 1
        model = choose_adapter(self.served, args.pop("adapter"))  # base against adapter: the page's #compare
        answer = lambda: inspect_text(model, self.tokenizer, **args, layout=self.layout, lens=self.lens)
        try:
            return JSONResponse(await run_in_threadpool(answer))
        except RequestError:
            raise
        except ValueError as e:  # logits with no distribution: the model's fault, not the request's
            return error_response(str(e), 500, kind="server_error")
        finally:
            self.inspecting -= 1

    async def completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        body = await self.read_json(request)
        req = await run_in_threadpool(
            lambda: parse_completion(
                body, model_name=self.name, tokenizer=self.tokenizer, vocab_size=self.model.vocab_size,
                max_tokens_limit=self.max_tokens_limit, max_samples=self.batcher.queue_size,
                adapters=self.adapters,
                layout=self.layout, context_length=self.model.context_length,
            )
        )  # fmt: skip
        queue: asyncio.Queue = asyncio.Queue()
        choices = self._choices(req, queue, asyncio.get_running_loop())
        sequences = [ch.sequence for ch in choices if ch.sequence is not None]
        try:
            self.batcher.submit(sequences)
        except QueueFull as e:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            self.metrics.rejected.labels("queue_full").inc()
            return error_response(str(e), 429, code="queue_full", kind="rate_limit_error", headers=headers)
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(sum(len(p) for p in req.prompts))
        reply = Reply(self, req, choices, queue, arrived)
        if req.stream:
            return StreamingResponse(reply.stream(), media_type="text/event-stream")
        return await reply.whole(request)

    def _choices(self, req: CompletionRequest, queue: asyncio.Queue, loop) -> list[Choice]:
        seed = secrets.randbelow(SEED_MAX + 1) if req.seed is None else req.seed
        options = SamplingOptions(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        score_only = req.max_tokens == 0 and req.echo and req.logprobs is not None
        bias = logit_bias_array(req.logit_bias, self.model.vocab_size)
        rows = None if req.attention is None else np.asarray(req.attention.rows, np.int32)
        choices = []
        for p, (prompt, text) in enumerate(zip(req.prompts, req.texts, strict=True)):
            for j in range(req.n):
                index = p * req.n + j
                emit = lambda event, i=index: loop.call_soon_threadsafe(queue.put_nowait, (i, event))
                sequence = None
                if req.max_tokens > 0 or score_only:
                    sequence = Sequence(
                        prompt, max(req.max_tokens, 1), options, sample_key_data(seed, j), emit,
                        prompt_logprobs=req.echo and req.logprobs is not None, logit_bias=bias,
                        adapter=req.adapter,
                        attention_rows=None if score_only else rows,
                    )  # fmt: skip
                echo = text if req.echo else ""
                choice_text = ChoiceText(
                    self.tokenizer, req.stop, echo, req.logprobs, req.attention, prompt_tokens=len(prompt)
                )
                choices.append(Choice(index, sequence, choice_text, prompt, discard_first=score_only))
        return choices


class Reply:
    """The answer to one completion request, whole or streamed, as its choices' tokens arrive."""

    def __init__(self, server: Server, req: CompletionRequest, choices: list[Choice], queue: asyncio.Queue,
                 arrived: float):  # fmt: skip
        self.server, self.req, self.choices, self.queue = server, req, choices, queue
        self.arrived = self.last_token = arrived  # time.monotonic()
        self.first_token = True
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        server.replies.add(self)  # until its events end: `Server.drain` may end it
        self.ending = False

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        model = ([self.server.name, *self.server.adapters])[self.req.adapter]
        chunk = {"id": self.id, "object": "text_completion", "created": self.created,
                 "model": model, "choices": choices}  # fmt: skip
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.req.prompts)
        completion = sum(ch.tokens for ch in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def events(self) -> AsyncIterator[tuple[Choice, str, str | None]]:
        """`(choice, text released, finish reason or None)` as tokens arrive, until every choice ends.
        Leaving early (a disconnect) cancels the sequences still drawing."""
        try:
            for ch in self.choices:
                if ch.sequence is None:
                    ch.done = True
                    yield ch, ch.text.echo, "length"
            while not all(ch.done for ch in self.choices):
                index, event = await self.queue.get()
                if index == END or self.ending:
                    raise Cut(SHUTTING_DOWN, 503, "server_shutting_down")
                ch = self.choices[index]
                if ch.done:
                    continue  # a cancelled sequence's last word
                if isinstance(event, Failed):
                    raise Cut(event.message, 500, None)
                if isinstance(event, Finished):
                    ch.done = True
                    piece = ch.text.finish()
                    yield ch, piece, "stop" if ch.text.stopped else "length"
                    continue
                assert isinstance(event, Token)
                if event.prompt is not None:
                    ch.text.add_prompt(ch.prompt, event)
                piece = "" if ch.echoed else ch.text.echo
                ch.echoed = True
                if ch.discard_first:  # drawn only to score the prompt
                    ch.done = True
                    yield ch, piece, "length"
                    continue
                ch.tokens += 1
                self._count_token(ch)
                piece += ch.text.add(event)
                if ch.text.stopped:
                    ch.done = True
                    self.server.batcher.cancel(ch.sequence)  # type: ignore[arg-type]
                yield ch, piece, "stop" if ch.text.stopped else None
        finally:
            self.server.replies.discard(self)
            for ch in self.choices:
                if not ch.done and ch.sequence is not None:
                    self.server.batcher.cancel(ch.sequence)

    def _count_token(self, ch: Choice) -> None:
        now, metrics = time.monotonic(), self.server.metrics
        metrics.tokens_predicted.inc()
        if self.first_token:
            metrics.time_to_first_token.observe(now - self.arrived)
            self.first_token = False
        elif ch.last_token is not None:
            metrics.time_per_output_token.observe(now - ch.last_token)
        ch.last_token = now

    async def stream(self) -> AsyncIterator[str]:
        try:
            async for ch, piece, finish in self.events():
                logprobs = ch.text.last_logprobs() if finish is None else None
                attention = ch.text.last_attention() if finish is None else None
                if piece or finish or logprobs or attention:
                    out = {"text": piece, "index": ch.index, "logprobs": logprobs, "finish_reason": finish}
                    if attention is not None:
                        out["attention"] = attention
                    yield _sse(self._chunk([out]))
            if self.req.include_usage:
                yield _sse(self._chunk([], self.usage()))
        except Cut as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": e.code}})
        yield "data: [DONE]\n\n"

    async def _collect(self) -> list[dict]:
        texts = {ch.index: "" for ch in self.choices}
        finishes: dict[int, str] = {}
        async for ch, piece, finish in self.events():
            texts[ch.index] += piece
            if finish is not None:
                finishes[ch.index] = finish
        choices = [{"text": texts[ch.index], "index": ch.index, "logprobs": ch.text.final_logprobs(),
                    "finish_reason": finishes[ch.index]} for ch in self.choices]  # fmt: skip
        if self.req.attention is not None:
            for out, ch in zip(choices, self.choices, strict=True):
                out["attention"] = ch.text.final_attention()
        return choices

    async def whole(self, request: Request) -> Response:
        """The whole answer; a client that leaves first cancels the work."""
        work = asyncio.ensure_future(self._collect())
        left = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if not work.done():
            work.cancel()
            return Response(status_code=499)  # nobody reads it
        try:
            choices = work.result()
        except Cut as e:
            return error_response(str(e), e.status, kind="server_error", code=e.code)
        return JSONResponse(self._chunk(choices, self.usage()))


def logit_bias_array(bias: dict[int, float] | None, vocab_size: int) -> np.ndarray | None:
    """A request's `logit_bias` as the `(vocab_size,)` array added to its logits: -100 is a ban
    (minus infinity: the token is never drawn, as OpenAI's "should result in a ban" promises)."""
    if bias is None:
        return None
    array = np.zeros(vocab_size, np.float32)
    for token, value in bias.items():
        array[token] = -np.inf if value <= -BIAS_LIMIT else value
    return array


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except TokenizerError as e:
        raise RequestError(f"the text cannot be encoded by this model's tokenizer: {e}", "content") from None


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    request.app.state.server.metrics.rejected.labels(exc.code or "invalid_request").inc()
    return error_response(str(exc), exc.status, param=exc.param, code=exc.code)


async def _server_error(request: Request, exc: Exception) -> Response:
    """A fault of the server's own (logged with its traceback by uvicorn), in OpenAI's JSON."""
    return error_response(f"internal server error ({type(exc).__name__}); see the server's log", 500,
                          kind="server_error")  # fmt: skip


async def _client_left(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # the client left while its body was read: nobody reads this


class PlainErrorsAsJSON:
    """ASGI middleware: a plain-text error that Starlette's own middleware answers (a foreign
    `Host`: "Invalid host header") becomes OpenAI's error JSON with the same status."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict = {}

        async def send_as_json(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                if Headers(raw=message["headers"]).get("content-type", "").startswith("text/plain"):
                    held.update(status=message["status"], body=b"")
                    return
            if held and message["type"] == "http.response.body":
                held["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    text = held["body"].decode("utf-8", "replace").strip() or "refused"
                    await error_response(text, held["status"])(scope, receive, send)
                return
            await send(message)

        await self.app(scope, receive, send_as_json)


class BearerKey(AuthenticationBackend):
    """The API key, checked as OpenAI's clients send it (`Authorization: Bearer KEY`) on every path
    but the page and `/health`."""

    def __init__(self, key: str):
        self.key = key.encode("utf-8")

    async def authenticate(self, conn: HTTPConnection):
        path = conn.url.path
        if path in PUBLIC_PATHS or path.startswith("/page/"):
            return None
        scheme, _, given = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            given.strip().encode("latin-1"), self.key
        ):
            raise AuthenticationError(
                "a missing or incorrect API key; send the server's --api-key as 'Authorization: Bearer KEY' "
                "(OpenAI's clients: api_key=KEY)"
            )
        return AuthCredentials(["api"]), SimpleUser("api")


def _unauthorized(conn: HTTPConnection, exc: AuthenticationError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"}
    conn.app.state.server.metrics.rejected.labels("unauthorized").inc()
    return error_response(str(exc), 401, code="invalid_api_key", headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)


async def _page(request: Request) -> Response:
    return FileResponse(PAGE / "index.html")


def _routes(server: Server) -> list:
    return [
        Route("/", _page),
        Route("/v1/models", server.models),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/inspect", server.inspect, methods=["POST"]),
        Route("/v1/card", server.card),
        Route("/v1/run", server.run),
        Route("/health", server.health),
        Route("/metrics", server.metrics_text),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Mount("/page", StaticFiles(directory=PAGE), name="page"),
    ]


def _follower(server: Server, run_dir: Path, every_s: float) -> RunFollower:
    from eqx_gpt.checkpoint import load_model  # the checkpoints of a run, only when one is followed

    if not (isinstance(every_s, int | float) and every_s > 0):
        raise ValueError(f"follow_every_s must be a positive number of seconds, got {every_s!r}")
    return RunFollower(
        run_dir, sha256=server.meta.get("sha256"), load=lambda path: load_model(path, kind="LanguageModel"),
        served=lambda: server.model, tokenizer=server.tokenizer, on_load=server.swap, every_s=every_s,
    )  # fmt: skip


def create_app(
    model: Decoder,
    tokenizer,
    *,
    meta: dict | None = None,
    name: str = "eqx_gpt",
    slots: int = 16,
    queue_size: int = 64,
    max_tokens_limit: int = 4096,
    keep: int | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    allowed_hosts: abc.Sequence[str] = LOOPBACK_HOSTS,
    follow: str | Path | None = None,
    follow_every_s: float = FOLLOW_EVERY_S,
    adapters: abc.Mapping[str, Any] | None = None,
) -> Starlette:
    """The served `model` (any `Decoder`: a `GPT`, or a model of your own) with its `tokenizer`, as an
    ASGI app (run it with uvicorn, or `eqx_gpt.serve.http_server.serve`, which adds the request
    deadline and the drain on SIGTERM).

    `name` is the model's id in the API; `meta` the checkpoint metadata (`load_model`'s third
    value, for the model card). `slots` sequences decode together, `queue_size` more may wait
    (beyond, 429 with `Retry-After`; a request asks for at most `queue_size` samples); a request
    asks for at most `max_tokens_limit` tokens; `keep` is the window's cut past the context (None:
    `generate`'s default). A body over `max_body_bytes` is refused (413). With `api_key`, every
    path but the page and `/health` needs `Authorization: Bearer <api_key>` (else 401). A request
    whose `Host` is not in `allowed_hosts` is refused (400): the default names only this machine,
    which a DNS-rebinding page cannot reach; `["*"]` takes any. With `follow`, a run folder (the
    one `model` was loaded from), its newest checkpoint is swapped in as it lands, looked for every
    `follow_every_s` seconds (`eqx_gpt.serve.follow`); it takes no `adapters`.

    `adapters` maps a name to `model` with LoRA adapters (`apply_lora`, `load_adapters` on it): each
    is served beside the base under its name (a request's `model`), all in the same batch
    (`stack_adapters`; no merged copy of the model per adapter). A name that is the base's, or one
    for another base, is a one-line error.
    """
    if not (isinstance(max_body_bytes, int) and max_body_bytes > 0):
        raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    if api_key is not None and not (isinstance(api_key, str) and api_key.strip() and api_key.isprintable()):
        raise ValueError("api_key must be a non-empty string of printable characters (or None)")
    if adapters is not None and name in adapters:
        raise ValueError(f"adapter name {name!r} is the base model's; give the adapter another name")
    if adapters and follow is not None:
        raise ValueError("follow takes no adapters: a run's new base would leave them on the old one")
    server = Server(model, tokenizer, meta or {}, name, slots=slots, queue_size=queue_size,
                    max_tokens_limit=max_tokens_limit, keep=keep, max_body_bytes=max_body_bytes,
                    adapters=adapters)  # fmt: skip
    if follow is not None:
        server.follower = _follower(server, Path(follow), follow_every_s)

    middleware = [
        Middleware(PlainErrorsAsJSON),
        Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)),
    ]
    if api_key is not None:
        middleware.append(
            Middleware(AuthenticationMiddleware, backend=BearerKey(api_key), on_error=_unauthorized)
        )
    handlers = {RequestError: _request_error, HTTPException: _http_error, ClientDisconnect: _client_left,
                Exception: _server_error}  # fmt: skip
    app = Starlette(routes=_routes(server), middleware=middleware, exception_handlers=handlers,
                    lifespan=server.lifespan)  # type: ignore[arg-type]  # fmt: skip
    app.state.server = server
    return app
