"""A completion request's JSON, checked field by field before any work: `parse_completion`.

Fields follow OpenAI's legacy completions API (`POST /v1/completions`); `top_k` is eqx_gpt's own
(llama.cpp's too): sample among the `top_k` most likely tokens, 0 or null for all; so is
`attention`, `{"layers": [...], "heads": [...]}`: the attention weights of those layers and heads
(every pair of them, at most `ATTENTION_MAX_PAIRS`) at every generated token, at most
`ATTENTION_MAX_WEIGHTS` weights in a reply. Every bad value raises a `RequestError` naming the
field, which the app answers with a 4xx and OpenAI's error JSON.

The body itself is read by `load_body`: strict UTF-8 JSON, integers of at most `MAX_DIGITS`
digits, nesting at most `MAX_NESTING` deep, and no lone surrogate (`"\\ud800"`, which is not
Unicode text), so that nothing later (an error message, an echoed prompt) fails on what it holds.
Work is bounded before it is done: the samples a request asks for are counted before any prompt
is encoded, and stop strings are at most `MAX_STOP_CHARS` long.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from eqx_gpt._checks import SEED_MAX
from eqx_gpt.errors import EqxGptError, TokenizerError
from eqx_gpt.serve.steps import ATTENTION_MAX_PAIRS, LOGPROBS_MAX

MAX_STOPS = 4  # OpenAI's bound on `stop`
MAX_STOP_CHARS = 256  # per stop string: the text held back and searched per token is this long at most
MAX_N = 16  # samples per prompt
MAX_DIGITS = 40  # an integer field's digits (a seed is at most 19): longer is refused while parsing
MAX_NESTING = 8  # the deepest a request nests (a list of token-id lists in a body is 3)
SHOWN_CHARS = 60  # of a bad value, quoted in an error message
ATTENTION_MAX_WEIGHTS = 1 << 22  # in a reply's `attention` (about 40 MB of JSON), counted before any work


class RequestError(EqxGptError):
    """A bad request: `param` names the field (None for the body as a whole), `status` the HTTP
    status, `code` OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class AttentionRequest:
    """The attention a request asks for: every pair of `layers` and `heads` (in that order, layer
    first), each pair the flat index `layer * n_heads + head` in `rows`."""

    layers: list[int]
    heads: list[int]
    rows: list[int]


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
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]; -100 bans it
    adapter: int = 0  # the model asked for: 0 the base, i the i-th LoRA adapter served beside it
    attention: AttentionRequest | None = None  # eqx_gpt's: the attention weights to return


def shown(value) -> str:
    """`repr(value)`, cut to `SHOWN_CHARS` characters: an error message quotes a bad value, never a
    megabyte of it."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise RequestError(
            f"the request body holds an integer of {len(digits.lstrip('-'))} digits; no field takes more "
            f"than {MAX_DIGITS}"
        )
    return int(digits)


def load_body(raw: bytes):
    """The JSON value of a request body, or a `RequestError` (400) saying what is wrong with it."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_int=_bounded_int)
    except UnicodeDecodeError as e:
        raise RequestError(
            f"the request body is not UTF-8 ({e.reason} at byte {e.start}); send UTF-8 JSON"
        ) from None
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise RequestError(
            f"the request body nests too deep; a request nests at most {MAX_NESTING} levels"
        ) from None
    _check_values(body)
    return body


def _check_values(body) -> None:
    """Refuse nesting deeper than `MAX_NESTING` and lone surrogates in any key or string (walked
    with a stack, not recursion)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(
                    f"the request body holds a lone surrogate ({shown(value[e.start])}), which is not "
                    f"Unicode text; send valid UTF-16 pairs or plain UTF-8"
                ) from None
        elif isinstance(value, list | dict):
            if depth > MAX_NESTING:
                raise RequestError(
                    f"the request body nests deeper than {MAX_NESTING} levels; no field needs that"
                )
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


# Fields OpenAI takes that change nothing here, accepted at these values only.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "suffix": None}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "echo",
         "logprobs", "stream", "stream_options", "user", "logit_bias", "attention", *NEUTRAL}  # fmt: skip
BIAS_LIMIT = 100  # OpenAI's range of a logit bias: [-100, 100]; -100 bans a token


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {shown(value)}", name)
    # Compared before any float(): an integer too large for a float compares exactly.
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise RequestError(f"{name} must be a number in [{low}, {high}], got {shown(value)}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {shown(value)}", name)
    if not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], got {shown(value)}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {shown(value)}", name)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {shown(stop)}", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise RequestError(
            f"a stop string is at most {MAX_STOP_CHARS} characters, got one of {len(longest)}", "stop"
        )
    return stops


def _prompt_list(body: dict) -> list:
    """The request's prompts, unencoded: a string, a list of strings, a list of token ids, or a
    list of such lists (OpenAI's four forms)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(
            "prompt must be a string, a list of strings, a list of token ids, or a list of such lists",
            "prompt",
        )
    return prompt


def _check_samples(prompts: int, n: int, max_samples: int) -> None:
    """Refuse a request for more samples than the queue holds, before any prompt is encoded."""
    if prompts * n > max_samples:
        raise RequestError(
            f"{prompts} prompt(s) x n={n} asks for {prompts * n} samples; this server takes at most "
            f"{max_samples} per request: send fewer prompts or a smaller n",
            "n" if n > 1 and prompts <= max_samples else "prompt",
        )  # fmt: skip


def _encoded(prompts: list, tokenizer, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids and text."""
    ids, texts = [], []
    for item in prompts:
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
                f"each prompt must be a non-empty string or list of token ids, got {shown(item)}", "prompt"
            )
    return ids, texts


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: an object from token ids (as decimal strings) to numbers in
    [-100, 100], added to the logits before temperature and the filters."""
    value = body.get("logit_bias")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise RequestError(
            f"logit_bias must be an object from token ids to numbers, got {shown(value)}", "logit_bias"
        )
    bias = {}
    for key, number in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise RequestError(
                f"logit_bias keys are token ids in [0, {vocab_size}), got {shown(key)}", "logit_bias"
            )
        if (
            isinstance(number, bool)
            or not isinstance(number, int | float)
            or not -BIAS_LIMIT <= number <= BIAS_LIMIT
        ):
            raise RequestError(
                f"logit_bias values are numbers in [-{BIAS_LIMIT}, {BIAS_LIMIT}], got {shown(number)} "
                f"for {key}",
                "logit_bias",
            )  # fmt: skip
        bias[int(key)] = float(number)
    if sum(b <= -BIAS_LIMIT for b in bias.values()) >= vocab_size:
        raise RequestError("logit_bias bans every token (-100 for each); leave some to draw", "logit_bias")
    return bias


def _attention(body: dict, layout, prompts: list[list[int]], n: int, max_tokens: int, context: int):
    """eqx_gpt's `attention`: `{"layers": [...], "heads": [...]}` within `layout` (the model's
    attention layers, `inspect.attention_layout`), at most `ATTENTION_MAX_PAIRS` pairs, and a
    reply of at most `ATTENTION_MAX_WEIGHTS` weights (each token's row is at most its window)."""
    value = body.get("attention")
    if value is None:
        return None
    if layout is None or layout.absent is not None:
        why = "this server has no attention layers to report" if layout is None else layout.absent
        raise RequestError(
            f"attention is not available for this model: {why}; leave attention out", "attention"
        )
    if not isinstance(value, dict) or set(value) != {"layers", "heads"}:
        raise RequestError(
            f'attention must be an object {{"layers": [...], "heads": [...]}} of layer and head indices, '
            f"got {shown(value)}", "attention",
        )  # fmt: skip
    layers = _indices(value["layers"], "layers", layout.n_layers, "attention layers")
    heads = _indices(value["heads"], "heads", layout.n_heads, "heads per layer")
    pairs = len(layers) * len(heads)
    if pairs > ATTENTION_MAX_PAIRS:
        raise RequestError(
            f"attention asks for {len(layers)} layers x {len(heads)} heads = {pairs} rows per token; at most "
            f"{ATTENTION_MAX_PAIRS}: ask for fewer layers or heads", "attention",
        )  # fmt: skip
    weights = n * max_tokens * pairs * sum(min(context, len(p) + max_tokens) for p in prompts)
    if weights > ATTENTION_MAX_WEIGHTS:
        raise RequestError(
            f"attention would return up to {weights} weights (samples x max_tokens x {pairs} rows x the "
            f"window); a reply holds at most {ATTENTION_MAX_WEIGHTS}: ask for fewer tokens, samples, "
            f"layers or heads", "attention",
        )  # fmt: skip
    rows = [layer * layout.n_heads + head for layer in layers for head in heads]
    return AttentionRequest(layers, heads, rows)


def _indices(value, name: str, count: int, what: str) -> list[int]:
    if not (isinstance(value, list) and value and _is_ids(value) and len(set(value)) == len(value)
            and all(0 <= i < count for i in value)):  # fmt: skip
        raise RequestError(
            f"attention.{name} must be a non-empty list of distinct indices in [0, {count - 1}] (this "
            f"model's {count} {what}), got {shown(value)}", f"attention.{name}",
        )  # fmt: skip
    return value


def _is_ids(items: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in items)


def model_index(body: dict, names: Sequence[str], *, required: bool = True) -> int:
    """The index in `names` (the base's, then every adapter's) of the model `body` names, as vLLM
    picks a LoRA adapter by `model`: an unknown name is 404 `model_not_found`. Without `required`, a
    missing `model` is the base."""
    model = body.get("model")
    if model is None and not required:
        return 0
    served = ", ".join(map(repr, names))
    if not isinstance(model, str):
        raise RequestError(f"model must be a string naming a served model ({served})", "model")
    if model not in names:
        raise RequestError(
            f"the model {shown(model)} does not exist; this server serves {served}", "model",
            status=404, code="model_not_found",
        )  # fmt: skip
    return list(names).index(model)


def parse_completion(
    body, *, model_name: str, tokenizer, vocab_size: int, max_tokens_limit: int, max_samples: int,
    adapters: Sequence[str] = (), layout=None, context_length: int = 0,
) -> CompletionRequest:  # fmt: skip
    """The checked `CompletionRequest` of a JSON `body`, or a `RequestError` naming the bad field.
    A request asks for at most `max_samples` samples (prompts times `n`). `model` names the base
    (`model_name`) or one of its `adapters`. `attention` within `layout`
    (`inspect.attention_layout`; None: refused), its rows at most `context_length` long."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise RequestError(f"unrecognized request argument supplied: {shown(unknown[0])}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral):
            raise RequestError(f"{name} is not supported by this server; leave it out", name)
    adapter = model_index(body, [model_name, *adapters])
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise RequestError("stream_options must be an object with include_usage only", "stream_options")
    n = _integer(body, "n", 1, 1, MAX_N) or 1
    unencoded = _prompt_list(body)
    _check_samples(len(unencoded), n, max_samples)
    stop = _stops(body)
    prompts, texts = _encoded(unencoded, tokenizer, vocab_size)
    top_k = _integer(body, "top_k", None, 0, 2**31 - 1)
    max_tokens = _integer(body, "max_tokens", 16, 0, max_tokens_limit) or 0
    return CompletionRequest(
        prompts=prompts,
        texts=texts,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        top_k=top_k or None,
        n=n,
        stop=stop,
        seed=_integer(body, "seed", None, 0, SEED_MAX),
        echo=_flag(body, "echo"),
        logprobs=_integer(body, "logprobs", None, 0, LOGPROBS_MAX),
        stream=_flag(body, "stream"),
        include_usage=_flag(options or {}, "include_usage"),
        logit_bias=_logit_bias(body, vocab_size),
        adapter=adapter,
        attention=_attention(body, layout, prompts, n, max_tokens, context_length),
    )


def _top_p(body: dict) -> float | None:
    value = body.get("top_p")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value <= 1):
        raise RequestError(f"top_p must be a number in (0, 1], got {shown(value)}", "top_p")
    return None if value == 1 else float(value)


def _object(body, fields: set[str]) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise RequestError(f"unrecognized request argument supplied: {shown(unknown[0])}", unknown[0])
    return body


def parse_tokenize(body) -> tuple[str, bool]:
    """`/tokenize`'s text and whether to give each token's piece: llama.cpp's `content` and
    `with_pieces` (vLLM's `prompt` is taken for `content`; `model` and `add_special` change nothing)."""
    body = _object(body, {"content", "prompt", "with_pieces", "model", "add_special"})
    name = "prompt" if "prompt" in body and "content" not in body else "content"
    text = body.get(name)
    if not isinstance(text, str):
        raise RequestError(f"{name} must be the text to tokenize, got {shown(text)}", name)
    return text, _flag(body, "with_pieces")


def parse_detokenize(body, vocab_size: int) -> list[int]:
    """`/detokenize`'s token ids (`tokens`), each in `[0, vocab_size)`."""
    tokens = _object(body, {"tokens", "model"}).get("tokens")
    if not (isinstance(tokens, list) and _is_ids(tokens)):
        raise RequestError(f"tokens must be a list of token ids, got {shown(tokens)}", "tokens")
    if not all(0 <= t < vocab_size for t in tokens):
        raise RequestError(f"tokens must be token ids in [0, {vocab_size})", "tokens")
    return tokens


INSPECT_FIELDS = {
    "prompt",
    "layer",
    "head",
    "position",
    "temperature",
    "top_k",
    "top_p",
    "all_heads",
    "window",
    "model",
}


def parse_inspect(body, layout, context_length: int, tokenizer, models: Sequence[str] = ()) -> dict:
    """The keyword arguments of `inspect_text` from the page's JSON `body`, or a `RequestError`:
    `layer` and `head` within `layout` (`inspect.attention_layout`), `position` within the text as
    cropped to `context_length`; and `adapter`, the index in `models` (the base's name, then its
    adapters') of the `model` named (none: the base)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - INSPECT_FIELDS)
    if unknown:
        raise RequestError(f"unrecognized request argument supplied: {shown(unknown[0])}", unknown[0])
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be a non-empty string", "prompt")
    try:
        tokens = tokenizer.encode(prompt)
    except TokenizerError as e:
        raise RequestError(f"prompt cannot be encoded by this model's tokenizer: {e}", "prompt") from None
    if not tokens:
        raise RequestError("prompt encodes to no tokens; pass some text", "prompt")
    shown_tokens = min(len(tokens), context_length)  # the text is cropped to the context
    return dict(
        tokens=tokens,
        layer=_integer(body, "layer", 0, 0, layout.n_layers - 1),
        head=_integer(body, "head", 0, 0, layout.n_heads - 1),
        position=_integer(body, "position", None, 0, shown_tokens - 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=_integer(body, "top_k", None, 0, 2**31 - 1) or None,
        top_p=_top_p(body),
        all_heads=_flag(body, "all_heads"),
        window=_integer(body, "window", None, 1, 2**31 - 1),  # past the text: all of it
        adapter=model_index(body, models, required=False) if models else 0,
    )
