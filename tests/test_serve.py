"""`eqx-gpt serve`: the OpenAI-compatible API on a tiny run, seeded equality with sample.py, bad
requests, the bounded queue, disconnects, the page's endpoints and the command's one-line errors."""

import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette")
from serve_fixtures import LiveServer, app_for, make_run  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from eqx_gpt import SamplingOptions  # noqa: E402
from eqx_gpt.commands import sample as sample_command  # noqa: E402
from eqx_gpt.commands import serve as serve_command  # noqa: E402
from eqx_gpt.serve.batcher import Finished, Sequence, sample_key_data  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")
LOCAL = "http://localhost"  # a name of this machine: the app answers no other Host by default


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def client(run):
    with TestClient(app_for(run, slots=4, queue_size=16), base_url=LOCAL) as c:
        yield c


def complete(client, **body):
    response = client.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def sample_py(capsys, run, prompt, *flags) -> list[str]:
    """The texts `sample.py` prints after the prompt, one per sample."""
    assert sample_command.main(["--checkpoint", str(run), "--prompt", prompt, *flags]) == 0
    out = capsys.readouterr().out[:-1]  # the closing newline
    return [s[len(prompt) :] for s in out.split("\n" + "-" * 40 + "\n")]


def test_lists_the_model_and_answers_a_completion_with_usage(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    answer = complete(client, prompt="ROMEO:", max_tokens=12, temperature=0.5)
    assert answer["object"] == "text_completion" and answer["model"] == "tiny"
    (choice,) = answer["choices"]
    assert len(choice["text"]) == 12 and choice["finish_reason"] == "length" and choice["index"] == 0
    assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}


def test_a_seeded_request_gives_sample_py_text_for_every_sample(client, run, capsys):
    # 60 tokens past a 32-token context: the window slides (is cut and re-prefilled) twice.
    flags = ["--max-new-tokens", "60", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.95"]
    expected = sample_py(capsys, run, "KING:", *flags, "--seed", "7", "--num-samples", "2")
    answer = complete(
        client, prompt="KING:", max_tokens=60, temperature=0.8, top_k=20, top_p=0.95, seed=7, n=2
    )
    assert [c["text"] for c in answer["choices"]] == expected
    assert expected[0] != expected[1]
    greedy = sample_py(capsys, run, "KING:", "--max-new-tokens", "40", "--temperature", "0")
    assert complete(client, prompt="KING:", max_tokens=40, temperature=0)["choices"][0]["text"] == greedy[0]


def test_seeded_text_is_the_same_served_alone_or_in_company(run):
    """Each slot draws with its own key and reads only its own cache, so company changes nothing
    here; the docs say why that is not guaranteed bit for bit (a batch's float sums)."""
    body = {"model": "tiny", "prompt": "First:", "max_tokens": 40, "temperature": 1.0, "seed": 3}
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as alone:
        text = alone.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with TestClient(app_for(run, slots=4), base_url=LOCAL) as busy:
        server = busy.app.state.server  # type: ignore[attr-defined]
        done = threading.Event()
        others = [
            Sequence(
                [5, 6, 7],
                200,
                SamplingOptions(temperature=1.0),
                sample_key_data(9, i),
                lambda e: isinstance(e, Finished) and done.set(),
            )  # fmt: skip
            for i in range(3)
        ]
        server.batcher.submit(others)
        assert busy.post("/v1/completions", json=body).json()["choices"][0]["text"] == text
        for s in others:
            server.batcher.cancel(s)


def test_streaming_sends_the_same_text_as_events_ending_in_done(client):
    body = dict(prompt="To be", max_tokens=30, temperature=0.9, seed=11)
    whole = complete(client, **body)["choices"][0]["text"]
    streamed = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}
    with client.stream("POST", "/v1/completions", json=streamed) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == whole
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 30 and chunks[-1]["choices"] == []


def test_stop_cuts_the_text_before_the_stop_string(client):
    body = dict(prompt="HAMLET:", max_tokens=40, temperature=1.0, seed=5)
    text = complete(client, **body)["choices"][0]["text"]
    stop = text[15:18]
    choice = complete(client, **body, stop=[stop, "never-seen"])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.index(stop)]


def test_echo_and_logprobs_in_openai_shape(client):
    # Past 16 tokens, within the context: the prompt's log-probabilities are computed in the prefill
    # of 32 positions, which test_serve_security.py's echoed prompt compiles too.
    prompt = "Ay me! sad hours seem long."
    choice = complete(client, prompt=prompt, max_tokens=5, seed=1, echo=True, logprobs=3)["choices"][0]
    lp = choice["logprobs"]
    n = len(prompt) + 5
    assert choice["text"].startswith(prompt) and len(choice["text"]) == n
    assert lp["tokens"] == list(choice["text"]) and lp["text_offset"] == list(range(n))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(top) == 3 and max(top.values()) >= lp["token_logprobs"][i + 1] - 1e-5
               for i, top in enumerate(lp["top_logprobs"][1:]))  # fmt: skip
    scored = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert scored["choices"][0]["text"] == prompt and len(scored["choices"][0]["logprobs"]["tokens"]) == len(
        prompt
    )
    assert scored["usage"]["completion_tokens"] == 0


BAD_REQUESTS = [
    ("not json", None, 400),
    (["a list"], None, 400),
    ({"model": None, "prompt": "x"}, "model", 400),
    ({"model": "gpt-4", "prompt": "x"}, "model", 404),
    ({"prompt": 5}, "prompt", 400),
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": "naïve ☃"}, "prompt", 400),  # characters the char model's vocabulary lacks
    ({"prompt": [1, 2, 9999]}, "prompt", 400),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", 400),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", 400),
    ({"prompt": "x", "temperature": -0.5}, "temperature", 400),
    ('{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature", 400),
    ({"prompt": "x", "top_p": 0}, "top_p", 400),
    ({"prompt": "x", "top_p": 1.5}, "top_p", 400),
    ({"prompt": "x", "top_k": -3}, "top_k", 400),
    ({"prompt": "x", "n": 0}, "n", 400),
    ({"prompt": "x", "stop": 3}, "stop", 400),
    ({"prompt": "x", "seed": -1}, "seed", 400),
    ({"prompt": "x", "logprobs": 9}, "logprobs", 400),
    ({"prompt": "x", "stream": "yes"}, "stream", 400),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", 400),
]


@pytest.mark.parametrize("body,param,status", BAD_REQUESTS)
def test_a_bad_request_is_a_4xx_naming_the_field_and_the_server_keeps_serving(client, body, param, status):
    if isinstance(body, dict):
        body = json.dumps({"model": "tiny", **body})
    elif not isinstance(body, str):
        body = json.dumps(body)
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert len(complete(client, prompt="ok", max_tokens=3)["choices"][0]["text"]) == 3


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens(client):
    long = "x" * 100 + "MENENIUS:"
    a = complete(client, prompt=long, max_tokens=8, seed=2)
    b = complete(client, prompt=long[-32:], max_tokens=8, seed=2)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["prompt_tokens"] == 109


def test_a_full_queue_answers_429_with_retry_after_then_serves_again(run):
    # 4 slots, as the other tests' servers have: their compiled programs serve this one too.
    with TestClient(app_for(run, slots=4, queue_size=1), base_url=LOCAL) as c:
        batcher = c.app.state.server.batcher  # type: ignore[attr-defined]
        hog = lambda i: Sequence([1, 2], 10**6, SamplingOptions(), sample_key_data(0, i), lambda e: None)
        first, second = [hog(i) for i in range(4)], hog(4)
        batcher.submit(first[:1])
        for sequence in first[1:]:  # one at a time: the queue holds one
            for _ in range(600):  # bounded: until the queue is empty again (a slot took the last)
                if not batcher.waiting:
                    break
                time.sleep(0.05)
            batcher.submit([sequence])
        for _ in range(600):  # bounded: until the four hold every slot
            if batcher.live == 4:
                break
            time.sleep(0.05)
        batcher.submit([second])  # waits: the queue is full
        response = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
        for sequence in [*first, second]:
            batcher.cancel(sequence)
        assert complete(c, prompt="x", max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_the_page_its_inspect_endpoint_and_the_model_card(client):
    page = client.get("/")
    assert (
        page.status_code == 200 and 'id="prompt"' in page.text and "http" not in page.text.split("<body")[0]
    )
    for name in ("app.js", "style.css"):
        assert client.get(f"/page/{name}").status_code == 200
    body = {"prompt": "ROMEO:", "layer": 1, "head": 2, "temperature": 1.0}
    seen = client.post("/v1/inspect", json=body).json()
    attention = np.array(seen["attention"])
    assert seen["tokens"] == list("ROMEO:") and attention.shape == (6, 6) and seen["position"] == 5
    assert np.allclose(attention.sum(1), 1, atol=1e-3) and np.allclose(np.triu(attention, 1), 0)
    before, after = seen["next_token"]["before"], seen["next_token"]["after"]
    assert len(before) == 10 and before == after  # temperature 1 and no filter: the same distribution
    filtered = client.post("/v1/inspect", json={**body, "top_k": 3, "position": 2}).json()
    assert filtered["position"] == 2 and sum(t["prob"] > 0 for t in filtered["next_token"]["after"]) == 3
    assert abs(sum(t["prob"] for t in filtered["next_token"]["after"]) - 1) < 1e-4
    bad = client.post("/v1/inspect", json={**body, "layer": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "layer"
    card = client.get("/v1/card").json()
    assert card["final_val_loss"] == 3.41 and card["config"]["context_length"] == 32
    assert card["parameters"] > 0 and card["curve"]["val"] == [[10, 3.8], [20, 3.4]]
    assert card["adapters"] == []


def test_the_official_openai_client_streamed_and_not(run):
    openai = pytest.importorskip("openai")
    with LiveServer(app_for(run, slots=4)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        answer = client.completions.create(
            model="tiny", prompt="KING:", max_tokens=20, seed=4, temperature=0.7
        )
        assert len(answer.choices[0].text) == 20 and answer.usage and answer.usage.completion_tokens == 20
        stream = client.completions.create(
            model="tiny", prompt="KING:", max_tokens=20, seed=4, temperature=0.7, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == answer.choices[0].text
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="tiny", prompt="KING:", temperature=-1)
        assert "temperature" in str(bad.value)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(run):
    httpx = pytest.importorskip("httpx")
    with LiveServer(app_for(run, slots=4)) as live:
        batcher = live.app.state.server.batcher
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert batcher.live == 1
        for _ in range(300):  # bounded: 30 s
            if batcher.live == 0:
                break
            time.sleep(0.1)
        assert batcher.live == 0 and batcher.waiting == 0


def test_serve_command_errors_are_one_line_with_exit_code_2(tmp_path, capsys, monkeypatch):
    assert serve_command.main(["--checkpoint", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint" in err
    real = serve_command.importlib.util.find_spec
    monkeypatch.setattr(
        serve_command.importlib.util, "find_spec", lambda n: None if n == "uvicorn" else real(n)
    )
    assert serve_command.main(["--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'eqx_gpt[serve]'" in err and "uv sync --extra serve" in err
