"""The HTTP face of a served model: a Starlette app (`create_app`) speaking OpenAI's completions API.

    GET  /v1/models        the one model served, in OpenAI's list shape
    POST /v1/completions   OpenAI's legacy completions (`stream` is server-sent events ending in
                           `data: [DONE]`); `top_k` is eqx_gpt's extension
    POST /v1/inspect       eqx_gpt's own: attention of a layer and head, next-token top 10 before and
                           after the filters (`eqx_gpt.serve.inspect`)
    GET  /v1/card          eqx_gpt's own: the model card (`eqx_gpt.serve.card`)
    GET  /                 the page (`page/`: HTML, CSS and JS, no build step, nothing fetched)

Requests are decoded together by one `Batcher` (its thread starts and stops with the app). The
ASGI side hands it `Sequence`s and reads their tokens from an `asyncio.Queue` that the batcher's
thread fills through `loop.call_soon_threadsafe`. A client that disconnects cancels its sequences,
which free their slots at the batcher's next step. Every error is OpenAI's JSON,
`{"error": {"message", "type", "param", "code"}}`, with a 4xx status for a bad request (naming the
field), 429 with `Retry-After` when the queue is full, and the server keeps serving.
"""

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from eqx_gpt._checks import SEED_MAX
from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.sampling import SamplingOptions
from eqx_gpt.serve.batcher import Batcher, Failed, Finished, QueueFull, Sequence, Token, sample_key_data
from eqx_gpt.serve.card import model_card
from eqx_gpt.serve.completions import ChoiceText
from eqx_gpt.serve.inspect import attention_layout, inspect_text
from eqx_gpt.serve.requests import CompletionRequest, RequestError, parse_completion, parse_inspect

PAGE = Path(__file__).resolve().parent / "page"
RETRY_AFTER_S = 1


def error_response(
    message: str,
    status: int,
    *,
    param: str | None = None,
    code: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict | None = None,
) -> JSONResponse:
    """OpenAI's error JSON with `status`."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


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


class Server:
    """The app's state: the model, its tokenizer and name, and the batcher decoding for it."""

    def __init__(self, model: Decoder, tokenizer, meta: dict, name: str, *, slots: int, queue_size: int,
                 max_tokens_limit: int, keep: int | None):  # fmt: skip
        self.model, self.tokenizer, self.meta, self.name = model, tokenizer, meta, name
        self.max_tokens_limit = max_tokens_limit
        self.batcher = Batcher(model, slots=slots, queue_size=queue_size, keep=keep)
        self.layout = attention_layout(model)  # the page's attention layers, found by type
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        model = {"id": self.name, "object": "model", "created": self.created, "owned_by": "eqx_gpt"}
        return JSONResponse({"object": "list", "data": [model]})

    async def card(self, request: Request) -> Response:
        return JSONResponse(
            await run_in_threadpool(model_card, self.model, self.meta, self.name, self.layout)
        )

    async def inspect(self, request: Request) -> Response:
        args = parse_inspect(await _json(request), self.layout, self.tokenizer)
        answer = lambda: inspect_text(self.model, self.tokenizer, **args, layout=self.layout)
        try:
            return JSONResponse(await run_in_threadpool(answer))
        except RequestError:
            raise
        except ValueError as e:  # logits with no distribution: the model's fault, not the request's
            return error_response(str(e), 500, kind="server_error")

    async def completions(self, request: Request) -> Response:
        req = parse_completion(
            await _json(request), model_name=self.name, tokenizer=self.tokenizer,
            vocab_size=self.model.vocab_size, max_tokens_limit=self.max_tokens_limit,
        )  # fmt: skip
        if len(req.prompts) * req.n > self.batcher.queue_size:
            raise RequestError(
                f"{len(req.prompts)} prompt(s) x n={req.n} samples exceed the queue's "
                f"{self.batcher.queue_size}; send fewer per request", "n",
            )  # fmt: skip
        queue: asyncio.Queue = asyncio.Queue()
        choices = self._choices(req, queue, asyncio.get_running_loop())
        sequences = [ch.sequence for ch in choices if ch.sequence is not None]
        try:
            self.batcher.submit(sequences)
        except QueueFull as e:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return error_response(str(e), 429, code="queue_full", kind="rate_limit_error", headers=headers)
        reply = Reply(self, req, choices, queue)
        if req.stream:
            return StreamingResponse(reply.stream(), media_type="text/event-stream")
        return await reply.whole(request)

    def _choices(self, req: CompletionRequest, queue: asyncio.Queue, loop) -> list[Choice]:
        seed = secrets.randbelow(SEED_MAX + 1) if req.seed is None else req.seed
        options = SamplingOptions(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p)
        score_only = req.max_tokens == 0 and req.echo and req.logprobs is not None
        choices = []
        for p, (prompt, text) in enumerate(zip(req.prompts, req.texts, strict=True)):
            for j in range(req.n):
                index = p * req.n + j
                emit = lambda event, i=index: loop.call_soon_threadsafe(queue.put_nowait, (i, event))
                sequence = None
                if req.max_tokens > 0 or score_only:
                    sequence = Sequence(
                        prompt, max(req.max_tokens, 1), options, sample_key_data(seed, j), emit,
                        prompt_logprobs=req.echo and req.logprobs is not None,
                    )  # fmt: skip
                echo = text if req.echo else ""
                choice_text = ChoiceText(self.tokenizer, req.stop, echo, req.logprobs)
                choices.append(Choice(index, sequence, choice_text, prompt, discard_first=score_only))
        return choices


class Reply:
    """The answer to one completion request, whole or streamed, as its choices' tokens arrive."""

    def __init__(self, server: Server, req: CompletionRequest, choices: list[Choice], queue: asyncio.Queue):
        self.server, self.req, self.choices, self.queue = server, req, choices, queue
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created,
                 "model": self.server.name, "choices": choices}  # fmt: skip
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
                ch = self.choices[index]
                if ch.done:
                    continue  # a cancelled sequence's last word
                if isinstance(event, Failed):
                    raise RuntimeError(event.message)
                if isinstance(event, Finished):
                    ch.done = True
                    yield ch, ch.text.finish(), "length"
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
                piece += ch.text.add(event)
                if ch.text.stopped:
                    ch.done = True
                    self.server.batcher.cancel(ch.sequence)  # type: ignore[arg-type]
                yield ch, piece, "stop" if ch.text.stopped else None
        finally:
            for ch in self.choices:
                if not ch.done and ch.sequence is not None:
                    self.server.batcher.cancel(ch.sequence)

    async def stream(self) -> AsyncIterator[str]:
        try:
            async for ch, piece, finish in self.events():
                logprobs = ch.text.last_logprobs() if finish is None else None
                if piece or finish or logprobs:
                    out = {"text": piece, "index": ch.index, "logprobs": logprobs, "finish_reason": finish}
                    yield _sse(self._chunk([out]))
            if self.req.include_usage:
                yield _sse(self._chunk([], self.usage()))
        except RuntimeError as e:
            yield _sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        yield "data: [DONE]\n\n"

    async def _collect(self) -> list[dict]:
        texts = {ch.index: "" for ch in self.choices}
        finishes: dict[int, str] = {}
        async for ch, piece, finish in self.events():
            texts[ch.index] += piece
            if finish is not None:
                finishes[ch.index] = finish
        return [{"text": texts[ch.index], "index": ch.index, "logprobs": ch.text.final_logprobs(),
                 "finish_reason": finishes[ch.index]} for ch in self.choices]  # fmt: skip

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
        except RuntimeError as e:
            return error_response(str(e), 500, kind="server_error")
        return JSONResponse(self._chunk(choices, self.usage()))


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object") from None


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return error_response(str(exc), exc.status, param=exc.param, code=exc.code)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)


async def _page(request: Request) -> Response:
    return FileResponse(PAGE / "index.html")


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
) -> Starlette:
    """The served `model` (any `Decoder`: a `GPT`, or a model of your own) with its `tokenizer`, as an
    ASGI app (run it with uvicorn).

    `name` is the model's id in the API; `meta` the checkpoint metadata (`load_model`'s third
    value, for the model card). `slots` sequences decode together, `queue_size` more may wait
    (beyond, 429 with `Retry-After`); a request asks for at most `max_tokens_limit` tokens; `keep`
    is the window's cut past the context (None: `generate`'s default).
    """
    server = Server(model, tokenizer, meta or {}, name, slots=slots, queue_size=queue_size,
                    max_tokens_limit=max_tokens_limit, keep=keep)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.batcher.start()
        try:
            yield
        finally:
            server.batcher.stop()

    routes = [
        Route("/", _page),
        Route("/v1/models", server.models),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/inspect", server.inspect, methods=["POST"]),
        Route("/v1/card", server.card),
        Mount("/page", StaticFiles(directory=PAGE), name="page"),
    ]
    handlers = {RequestError: _request_error, HTTPException: _http_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)  # type: ignore[arg-type]
    app.state.server = server
    return app
