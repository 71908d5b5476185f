"""A completion request's JSON, checked field by field before any work: `parse_completion`.

Fields follow OpenAI's legacy completions API (`POST /v1/completions`); `top_k` is eqx_gpt's own
(llama.cpp's too): sample among the `top_k` most likely tokens, 0 or null for all. Every bad value
raises a `RequestError` naming the field, which the app answers with a 4xx and OpenAI's error JSON.
"""

import math
from dataclasses import dataclass

from eqx_gpt._checks import SEED_MAX
from eqx_gpt.errors import EqxGptError, TokenizerError
from eqx_gpt.serve.steps import LOGPROBS_MAX

MAX_STOPS = 4  # OpenAI's bound on `stop`
MAX_N = 16  # samples per prompt


class RequestError(EqxGptError):
    """A bad request: `param` names the field (None for the body as a whole), `status` the HTTP
    status, `code` OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class CompletionRequest:
    """A checked request. `prompts` holds each prompt's token ids (not yet cropped to the context)
    and `texts` its text (for `echo`)."""

    prompts: list[list[int]]
    texts: list[str]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    n: int
    stop: list[str]
    seed: int | None
    echo: bool
    logprobs: int | None
    stream: bool
    include_usage: bool


# Fields OpenAI takes that change nothing here, accepted at these values only.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "logit_bias": {}, "suffix": None}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "echo",
         "logprobs", "stream", "stream_options", "user", *NEUTRAL}  # fmt: skip


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if not (math.isfinite(value) and low <= value <= high):
        raise RequestError(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], got {value}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return stops


def _prompts(body: dict, tokenizer, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids and text: a string, a list of strings, a list of token ids, or a
    list of such lists (OpenAI's four forms)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(
            "prompt must be a string, a list of strings, a list of token ids, or a list of such lists",
            "prompt",
        )
    ids, texts = [], []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise RequestError("prompt is empty; pass some text to continue", "prompt")
            try:
                ids.append(tokenizer.encode(item))
            except TokenizerError as e:
                raise RequestError(
                    f"prompt cannot be encoded by this model's tokenizer: {e}", "prompt"
                ) from None
            texts.append(item)
        elif isinstance(item, list) and item and _is_ids(item):
            if not all(0 <= t < vocab_size for t in item):
                raise RequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
            ids.append(list(item))
            texts.append(tokenizer.decode(item))
        else:
            raise RequestError(
                f"each prompt must be a non-empty string or list of token ids, got {item!r}", "prompt"
            )
    return ids, texts


def _is_ids(items: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def parse_completion(
    body, *, model_name: str, tokenizer, vocab_size: int, max_tokens_limit: int
) -> CompletionRequest:
    """The checked `CompletionRequest` of a JSON `body`, or a `RequestError` naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise RequestError(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise RequestError(f"{name} is not supported by this server; leave it out", name)
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(f"model must be a string naming the served model ({model_name!r})", "model")
    if model != model_name:
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
            status=404, code="model_not_found",
        )  # fmt: skip
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise RequestError("stream_options must be an object with include_usage only", "stream_options")
    prompts, texts = _prompts(body, tokenizer, vocab_size)
    top_k = _integer(body, "top_k", None, 0, 2**31 - 1)
    return CompletionRequest(
        prompts=prompts,
        texts=texts,
        max_tokens=_integer(body, "max_tokens", 16, 0, max_tokens_limit) or 0,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        top_k=top_k or None,
        n=_integer(body, "n", 1, 1, MAX_N) or 1,
        stop=_stops(body),
        seed=_integer(body, "seed", None, 0, SEED_MAX),
        echo=_flag(body, "echo"),
        logprobs=_integer(body, "logprobs", None, 0, LOGPROBS_MAX),
        stream=_flag(body, "stream"),
        include_usage=_flag(options or {}, "include_usage"),
    )


def _top_p(body: dict) -> float | None:
    value = body.get("top_p")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value <= 1):
        raise RequestError(f"top_p must be a number in (0, 1], got {value!r}", "top_p")
    return None if value == 1 else float(value)


INSPECT_FIELDS = {"prompt", "layer", "head", "position", "temperature", "top_k", "top_p"}


def parse_inspect(body, config, tokenizer) -> dict:
    """The keyword arguments of `inspect_text` from the page's JSON `body`, or a `RequestError`."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - INSPECT_FIELDS)
    if unknown:
        raise RequestError(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be a non-empty string", "prompt")
    try:
        tokens = tokenizer.encode(prompt)
    except TokenizerError as e:
        raise RequestError(f"prompt cannot be encoded by this model's tokenizer: {e}", "prompt") from None
    if not tokens:
        raise RequestError("prompt encodes to no tokens; pass some text", "prompt")
    return dict(
        tokens=tokens,
        layer=_integer(body, "layer", 0, 0, config.n_layers - 1),
        head=_integer(body, "head", 0, 0, config.n_heads - 1),
        position=_integer(body, "position", None, 0, 2**31 - 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=_integer(body, "top_k", None, 0, 2**31 - 1) or None,
        top_p=_top_p(body),
    )
