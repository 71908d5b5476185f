"""What operators wire up first: `/health`, `/metrics` (read back by Prometheus's own parser),
`/tokenize` and `/detokenize` with token pieces."""

import pytest

pytest.importorskip("starlette")
prometheus_parser = pytest.importorskip("prometheus_client.parser")
from serve_fixtures import app_for, make_run  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from test_serve_security import HighBytes  # noqa: E402

from eqx_gpt import create_app, load_model  # noqa: E402
from eqx_gpt.serve.completions import token_pieces  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")
LOCAL = "http://localhost"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"))


def metrics(client) -> dict[str, float]:
    """Every sample of `/metrics` by its name and labels, as Prometheus's parser reads them."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            key = sample.name + (f"{{{labels}}}" if labels else "")
            if "le" not in sample.labels:
                samples[key] = sample.value
    return samples


def test_health_is_ok_while_serving_and_503_once_draining(run):
    with TestClient(app_for(run, slots=4, api_key="k"), base_url=LOCAL) as c:
        assert c.get("/health").status_code == 200 and c.get("/health").json() == {"status": "ok"}  # no key
        c.app.state.server._drain(60)  # type: ignore[attr-defined]
        response = c.get("/health")
        assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        refused = c.post("/v1/completions", json=body, headers={"authorization": "Bearer k"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"


def test_metrics_count_tokens_requests_rejections_and_latency(run):
    with TestClient(app_for(run, slots=4, queue_size=4), base_url=LOCAL) as c:
        before = metrics(c)
        assert before["eqx_gpt_slots"] == 4 and before["eqx_gpt_tokens_predicted_total"] == 0
        body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 7, "n": 2, "seed": 1}
        assert c.post("/v1/completions", json=body).status_code == 200
        assert c.post("/v1/completions", json={**body, "temperature": -1}).status_code == 400
        assert (
            c.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"}).status_code
            == 415
        )
        after = metrics(c)
    assert after["eqx_gpt_requests_total"] == 1 and after["eqx_gpt_prompt_tokens_total"] == 6
    assert after["eqx_gpt_tokens_predicted_total"] == 14
    assert after["eqx_gpt_time_to_first_token_seconds_count"] == 1
    assert (
        after["eqx_gpt_time_per_output_token_seconds_count"] == 14 - 1 - 1
    )  # each choice's first has no gap before
    assert after["eqx_gpt_requests_rejected_total{reason=invalid_request}"] == 1
    assert after["eqx_gpt_requests_rejected_total{reason=unsupported_media_type}"] == 1
    steps, busy = after["eqx_gpt_decode_steps_total"], after["eqx_gpt_busy_slot_steps_total"]
    assert steps >= 6 and steps <= busy <= 2 * steps  # 2 samples of 7 tokens: 6 decode steps each
    assert after["eqx_gpt_requests_processing"] == 0 and after["eqx_gpt_requests_deferred"] == 0


def test_metrics_need_the_api_key_when_one_is_set(run):
    with TestClient(app_for(run, slots=4, api_key="k"), base_url=LOCAL) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"authorization": "Bearer k"}).status_code == 200


BAD = [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "☃"}, "content"),  # a character the char model's vocabulary lacks
    ("/tokenize", {"content": "x", "frob": 1}, "frob"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/detokenize", {"tokens": "x"}, "tokens"),
]


def test_tokenize_and_detokenize_with_pieces(run):
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as c:
        tokenizer = c.app.state.server.tokenizer  # type: ignore[attr-defined]
        ids = tokenizer.encode("ROMEO: hi")
        plain = c.post("/tokenize", json={"content": "ROMEO: hi"}).json()
        assert plain["tokens"] == ids and plain["count"] == 9 and plain["max_model_len"] == 32
        assert c.post("/tokenize", json={"prompt": "ROMEO: hi"}).json()["tokens"] == ids  # vLLM's field
        pieces = c.post("/tokenize", json={"content": "ROMEO: hi", "with_pieces": True}).json()["tokens"]
        assert pieces == [{"id": i, "piece": ch} for i, ch in zip(ids, "ROMEO: hi", strict=True)]
        assert c.post("/detokenize", json={"tokens": ids}).json() == {"content": "ROMEO: hi"}
        for path, body, param in BAD:
            bad = c.post(path, json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param


def test_tokenize_gives_bytes_that_are_not_text_as_their_values(run):
    model, _, _ = load_model(run, kind="GPT")
    with TestClient(create_app(model, HighBytes(), name="b", slots=4), base_url=LOCAL) as c:
        pieces = c.post("/tokenize", json={"content": "AZ", "with_pieces": True}).json()["tokens"]
        assert pieces == [{"id": 0, "piece": "A"}, {"id": 25, "piece": "Z"}]
        assert c.post("/tokenize", json={"content": "A"}).json()["tokens"] == [0]
        assert c.post("/detokenize", json={"tokens": [0, 40]}).json() == {"content": "A\ufffd"}
        pieces = token_pieces(HighBytes(), [1, 40])
        assert pieces == [{"id": 1, "piece": "B"}, {"id": 40, "piece": [0x80 + 40]}]


def test_logit_bias_bans_what_greedy_decoding_would_pick_and_100_selects_a_token(run):
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as c:
        tokenizer = c.app.state.server.tokenizer  # type: ignore[attr-defined]
        body = {"model": "tiny", "prompt": "KING:", "max_tokens": 40, "temperature": 0}
        greedy = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        banned = tokenizer.encode(greedy[0])[0]
        bias = {str(banned): -100}
        text = c.post("/v1/completions", json={**body, "logit_bias": bias}).json()["choices"][0]["text"]
        assert greedy[0] not in text and len(text) == 40  # never drawn, in prefill or in decode steps
        sampled = {**body, "temperature": 1.5, "seed": 3, "logit_bias": bias, "max_tokens": 200}
        assert greedy[0] not in c.post("/v1/completions", json=sampled).json()["choices"][0]["text"]
        chosen = tokenizer.encode("Q")[0]
        forced = {**body, "temperature": 1.0, "seed": 1, "logit_bias": {str(chosen): 100}}
        assert c.post("/v1/completions", json=forced).json()["choices"][0]["text"] == "Q" * 40
        small = {
            **body,
            "logit_bias": {str(banned): 0.5},
        }  # a small bias changes little: the same greedy text
        assert c.post("/v1/completions", json=small).json()["choices"][0]["text"][:1] == greedy[:1]
        for bad in ({"x": 1}, {"-1": 1}, {"999": 1}, {"3": 101}, {"3": "a"}, [1], {"3": None}):
            response = c.post("/v1/completions", json={**body, "logit_bias": bad})
            assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"
        everything = {str(i): -100 for i in range(tokenizer.vocab_size)}
        assert c.post("/v1/completions", json={**body, "logit_bias": everything}).status_code == 400
