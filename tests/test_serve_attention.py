"""Attention through the API (eqx_gpt's `attention` on `/v1/completions`): each generated token's
query row, for the chosen layers and heads, equals a full forward pass's (and `/v1/inspect`'s) at
that position, streamed or not, while the request decodes in the batch with others, whose seeded
tokens stay what they are alone; a step in which no slot asks runs the decode step without
attention output; bad values are a 400 naming the field."""

import json
import threading

import numpy as np
import pytest

pytest.importorskip("starlette")
from serve_fixtures import CONTEXT, app_for, make_run, query_rows  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from eqx_gpt import load_model  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")
LOCAL = "http://localhost"  # a name of this machine: the app answers no other Host by default
# Any order: the reply keeps it. Every test asks these 6 rows: the programs that record attention
# are compiled per number of rows asked (rounded up to a power of two), so one number compiles once.
ASK = {"layers": [1, 0], "heads": [3, 0, 2]}
# The second filters its tokens, so the asking request decodes in steps compiled with the filters
# (its own slot keeping every token); both filters, as test_serve.py's seeded request: its programs.
OTHERS = [
    dict(prompt="KING:", max_tokens=50, temperature=0.9, seed=4),
    dict(prompt="First Citizen:", max_tokens=45, temperature=1.0, top_k=20, top_p=0.95, seed=8),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def client(run):
    """One server for the tests of refused requests (a server's start traces its model's checks)."""
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as c:
        yield c


@pytest.fixture(scope="module")
def model_and_tokenizer(run):
    model, tokenizer, _ = load_model(run, kind="GPT")
    return model, tokenizer


class DecodeCalls:
    """Wraps a server's batched decode step, recording per call whether it computed attention and
    how many slots were live: evidence the asking request decoded in the batch with others."""

    def __init__(self, server):
        self.calls: list[tuple[bool, int]] = []
        batcher, decode = server.batcher, server.batcher.programs.decode

        def recorded(*args, rows=None, **kwargs):
            self.calls.append((rows is not None, batcher.live))
            return decode(*args, rows=rows, **kwargs)

        batcher.programs.decode = recorded


def post(client, body: dict) -> dict:
    response = client.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def check_rows(model, tokenizer, prompt: str, choice: dict, ask: dict) -> None:
    """Every token's rows equal the full forward pass's last row over the text its window held, and
    sum to 1."""
    generated = tokenizer.encode(choice["text"])
    text = tokenizer.encode(prompt) + generated
    attention = choice["attention"]
    assert attention["layers"] == ask["layers"] and attention["heads"] == ask["heads"]
    assert len(attention["weights"]) == len(attention["start"]) == len(generated)
    for k, (start, rows) in enumerate(zip(attention["start"], attention["weights"], strict=True)):
        query = len(text) - len(generated) + k - 1  # the position fed when token k was drawn
        full = query_rows(model, text, start, query)  # (layers, heads, window)
        expected = full[np.ix_(ask["layers"], ask["heads"])]
        np.testing.assert_allclose(np.asarray(rows), expected, atol=2e-6)
        np.testing.assert_allclose(np.asarray(rows).sum(-1), 1.0, atol=1e-4)


def test_attention_in_company_equals_a_full_forward_pass_and_the_others_keep_their_tokens(
    run, model_and_tokenizer
):
    model, tokenizer = model_and_tokenizer
    asking = dict(prompt="ROMEO:", max_tokens=20, temperature=0.8, seed=5)
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as alone:
        expected = [post(alone, body)["choices"][0]["text"] for body in OTHERS]
        plain = post(alone, asking)["choices"][0]
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as busy:
        calls = DecodeCalls(busy.app.state.server)  # type: ignore[attr-defined]
        texts: dict[int, str] = {}
        threads = [
            threading.Thread(target=lambda i=i, b=b: texts.update({i: post(busy, b)["choices"][0]["text"]}))
            for i, b in enumerate(OTHERS)
        ]
        for t in threads:
            t.start()
        while not calls.calls:  # the others are decoding: the asking request joins their batch
            threading.Event().wait(0.01)
        choice = post(busy, {**asking, "attention": ASK})["choices"][0]
        for t in threads:
            t.join()
    assert [texts[0], texts[1]] == expected
    assert choice["text"] == plain["text"] and "attention" not in plain  # asking changes no token
    assert any(asked and live >= 2 for asked, live in calls.calls)  # decoded in the batch with others
    check_rows(model, tokenizer, asking["prompt"], choice, ASK)


def test_streamed_attention_comes_one_token_per_chunk_and_equals_the_whole_reply(run):
    body = dict(prompt="To be", max_tokens=12, temperature=1.0, seed=2, attention=ASK)
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as client:
        whole = post(client, body)["choices"][0]["attention"]
        chunks = streamed(client, body)
    per_token = [c["choices"][0]["attention"] for c in chunks if "attention" in c["choices"][0]]
    assert all(len(a["weights"]) == len(a["start"]) == 1 for a in per_token)
    assert [a["weights"][0] for a in per_token] == whole["weights"]
    assert [a["start"][0] for a in per_token] == whole["start"] == [0] * 12
    assert all(a["layers"] == ASK["layers"] and a["heads"] == ASK["heads"] for a in per_token)


def test_past_the_context_each_row_covers_the_window_the_model_saw(run, model_and_tokenizer):
    """40 tokens after a 6-token prompt slide a 32-token window: the rows then start later."""
    model, tokenizer = model_and_tokenizer
    body = dict(prompt="HAMLET", max_tokens=40, temperature=1.0, seed=9, attention=ASK)
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as client:
        choice = post(client, body)["choices"][0]
        inspected = client.post("/v1/inspect", json={"prompt": "HAMLET" + choice["text"][:10], "layer": 1,
                                                      "head": 2}).json()  # fmt: skip
    starts, weights = choice["attention"]["start"], choice["attention"]["weights"]
    assert starts[0] == 0 and starts[-1] > 0 and max(len(rows[0][0]) for rows in weights) == CONTEXT
    check_rows(model, tokenizer, "HAMLET", choice, ASK)
    # /v1/inspect (4 decimals) shows the same rows: token k's is the inspected text's row 6 + k - 1.
    for k in range(10):
        row = choice["attention"]["weights"][k][0][2]  # ASK's layer 1 (first), head 2 (third)
        np.testing.assert_allclose(row, inspected["attention"][6 + k - 1][: len(row)], atol=6e-5)


def test_no_request_asking_runs_the_decode_step_without_attention(run):
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as client:
        calls = DecodeCalls(client.app.state.server)  # type: ignore[attr-defined]
        answer = post(client, dict(prompt="ROMEO:", max_tokens=10, seed=1))
        assert "attention" not in answer["choices"][0]
        assert calls.calls and not any(asked for asked, _ in calls.calls)
        post(client, dict(prompt="ROMEO:", max_tokens=10, seed=1, attention=ASK))
        assert any(asked for asked, _ in calls.calls)


@pytest.mark.parametrize(
    "attention, param, says",
    [
        ({"layers": [2], "heads": [0]}, "attention.layers", "[0, 1]"),
        ({"layers": [0], "heads": [4]}, "attention.heads", "[0, 3]"),
        ({"layers": [], "heads": [0]}, "attention.layers", "non-empty"),
        ({"layers": [0, 0], "heads": [0]}, "attention.layers", "distinct"),
        ({"layers": [True], "heads": [0]}, "attention.layers", "indices"),
        ({"layers": [0]}, "attention", '"heads"'),
        ({"layers": [0], "heads": [0], "rows": 1}, "attention", '"layers"'),
        ("all", "attention", "object"),
    ],
)
def test_a_bad_attention_is_a_400_naming_the_field(client, attention, param, says):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "attention": attention}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert post(client, dict(prompt="x", max_tokens=2))["choices"][0]["text"]  # still serving


def test_what_a_request_may_ask_is_bounded_before_any_work(client, monkeypatch):
    from eqx_gpt.serve import requests

    body = {"model": "tiny", "prompt": "x", "attention": {"layers": [0, 1], "heads": [0, 1, 2]}}
    many = client.post("/v1/completions", json={**body, "n": 16, "max_tokens": 4096}).json()["error"]
    assert many["param"] == "attention" and f"at most {requests.ATTENTION_MAX_WEIGHTS}" in many["message"]
    monkeypatch.setattr(requests, "ATTENTION_MAX_PAIRS", 4)
    wide = client.post("/v1/completions", json={**body, "max_tokens": 2}).json()["error"]
    assert wide["param"] == "attention" and "2 layers x 3 heads = 6 rows" in wide["message"]


def test_each_choice_has_its_own_lists_cut_with_its_text_at_a_stop(run):
    """n=2 with echo, logprobs and a stop string: each choice's attention covers its generated
    tokens kept (logprobs' tokens past the echoed prompt), not those after the stop."""
    body = dict(prompt="KING:", max_tokens=30, temperature=1.0, seed=6, n=2, echo=True, logprobs=0)
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as client:
        whole = post(client, {**body, "attention": ASK})["choices"]
        stop = whole[0]["text"][len("KING:") + 12 :][:2]
        cut = post(client, {**body, "attention": ASK, "stop": [stop]})["choices"]
    assert cut[0]["finish_reason"] == "stop"
    for choice in [*whole, *cut]:
        generated = len(choice["logprobs"]["tokens"]) - len("KING:")
        assert len(choice["attention"]["weights"]) == len(choice["attention"]["start"]) == generated
    assert len(cut[0]["attention"]["weights"]) < 30 and len(whole[0]["attention"]["weights"]) == 30
    assert (
        cut[0]["attention"]["weights"]
        == whole[0]["attention"]["weights"][: len(cut[0]["attention"]["weights"])]
    )
