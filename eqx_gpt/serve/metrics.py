"""The server's Prometheus metrics (`GET /metrics`), kept by `prometheus_client` in one registry
per app: `ServerMetrics`.

Names follow llama.cpp's server (`prompt_tokens_total`, `tokens_predicted_total`,
`requests_processing`, `requests_deferred`) and vLLM's latency histograms, prefixed `eqx_gpt_`:

    eqx_gpt_prompt_tokens_total             counter    prompt tokens of the requests admitted
    eqx_gpt_tokens_predicted_total          counter    tokens generated (sent or not)
    eqx_gpt_requests_total                  counter    completion requests admitted
    eqx_gpt_requests_rejected_total{reason} counter    requests refused, by OpenAI error code (or
                                                       `invalid_request`, `unauthorized`)
    eqx_gpt_requests_processing             gauge      completion requests in flight
    eqx_gpt_requests_deferred               gauge      samples waiting for a slot
    eqx_gpt_slots_busy / eqx_gpt_slots      gauges     slots decoding now / all slots
    eqx_gpt_decode_steps_total              counter    decode steps run
    eqx_gpt_busy_slot_steps_total           counter    busy slots summed over steps: divided by the
                                                       steps, the busy slots per step
    eqx_gpt_time_to_first_token_seconds     histogram  a request's arrival to its first token
    eqx_gpt_time_per_output_token_seconds   histogram  between a choice's consecutive tokens
"""

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PREFIX = "eqx_gpt_"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _BatcherSteps(Collector):
    """The batcher's own step counters, read when scraped."""

    def __init__(self, batcher):
        self.batcher = batcher

    def collect(self):
        steps = CounterMetricFamily(
            PREFIX + "decode_steps", "Decode steps run (each advances every busy slot)"
        )
        steps.add_metric([], self.batcher.steps)
        busy = CounterMetricFamily(
            PREFIX + "busy_slot_steps",
            "Busy slots summed over decode steps (over decode_steps: busy slots per step)",
        )
        busy.add_metric([], self.batcher.busy_slot_steps)
        return [steps, busy]


class ServerMetrics:
    """The metrics of one app: its counters, gauges read from `batcher` and `in_flight` when scraped,
    and its histograms. `exposition()` is the text `/metrics` answers."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, batcher, in_flight):
        self.registry = registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", registry=registry
        )
        self.tokens_predicted = Counter(PREFIX + "tokens_predicted", "Tokens generated", registry=registry)
        self.requests = Counter(PREFIX + "requests", "Completion requests admitted", registry=registry)
        self.rejected = Counter(
            PREFIX + "requests_rejected", "Requests refused, by reason", ["reason"], registry=registry
        )
        Gauge(
            PREFIX + "requests_processing", "Completion requests in flight", registry=registry
        ).set_function(in_flight)
        Gauge(PREFIX + "requests_deferred", "Samples waiting for a slot", registry=registry).set_function(
            lambda: batcher.waiting
        )
        Gauge(PREFIX + "slots_busy", "Slots decoding now", registry=registry).set_function(
            lambda: batcher.live
        )
        Gauge(PREFIX + "slots", "Slots in all", registry=registry).set(len(batcher.slots))
        registry.register(_BatcherSteps(batcher))
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=TTFT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds", "Between consecutive tokens of a choice",
            buckets=TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
