"""`eqx-gpt serve`: a trained model behind an OpenAI-compatible completions API and a web page.

    batcher     continuous batching: fixed slots decoded together, one token per step, in one thread
    steps       the batcher's jitted programs (prefill into a slot, decode every slot)
    requests    a completion request's JSON, checked field by field (`RequestError` names the field)
    completions the answer's text: stop strings, incremental decoding, logprobs in OpenAI's shape
    inspect     the page's endpoint: a layer's attention, next-token top 10 before/after filters, the lens
    lens        the logit lens: each block's residual stream through the model's own tail
    follow      `--follow`: a run folder's newest checkpoint swapped in as it lands
    card        the model card: config, parameter count, the run's losses from metrics.jsonl
    api         the Starlette app (`create_app`) tying them to HTTP; page/ the static page at `/`
    metrics     the app's Prometheus metrics (`/metrics`)
    http_server running the app with uvicorn: limits, a request deadline, a drain on SIGTERM

Only `api`, `metrics` and `http_server` need the optional `serve` extra (Starlette, uvicorn,
prometheus_client); the rest is plain JAX.
"""

from eqx_gpt.serve.batcher import Batcher


def create_app(model, tokenizer, **options):
    """The served `model` as an ASGI app: `eqx_gpt.serve.api.create_app`, imported only when called
    (it needs the `serve` extra; `import eqx_gpt` does not)."""
    from eqx_gpt.serve.api import create_app as make_app

    return make_app(model, tokenizer, **options)


__all__ = ["Batcher", "create_app"]
