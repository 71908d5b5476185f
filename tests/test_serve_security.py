"""The server against a careless or hostile client: what it refuses before any work (foreign
`Host`, non-JSON bodies, large bodies, no API key), bodies that once gave a 500 (huge integers,
deep nesting, lone surrogates), bounded work (samples counted before encoding, stop strings),
`bytes:` keys in `top_logprobs`, and a connection that sends half a request or leaves mid-body."""

import json
import logging
import socket
import time

import pytest

pytest.importorskip("starlette")
from serve_fixtures import LiveServer, app_for, make_run  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from eqx_gpt import create_app, load_model  # noqa: E402
from eqx_gpt.serve.batcher import Token  # noqa: E402
from eqx_gpt.serve.completions import ChoiceText  # noqa: E402
from eqx_gpt.serve.http_server import Limits  # noqa: E402
from eqx_gpt.serve.requests import MAX_STOP_CHARS  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")
LOCAL = "http://localhost"
JSON = {"content-type": "application/json"}
GOOD = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 3}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def client(run):
    with TestClient(app_for(run, slots=4, queue_size=8, max_body_bytes=4096), base_url=LOCAL) as c:
        yield c


def openai_error(response, status: int, param=None) -> dict:
    """The error of `response`, checked to be OpenAI's JSON with `status`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text and error["param"] == param
    return error


def still_serves(client, **headers) -> None:
    answer = client.post("/v1/completions", json=GOOD, headers=headers)
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"


def test_a_body_over_the_limit_is_413_before_it_is_read(client):
    declared = client.post("/v1/completions", content=b"{" + b" " * 5000 + b"}", headers=JSON)
    assert openai_error(declared, 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the running count refuses it
        yield json.dumps(GOOD)[:-1].encode()
        for _ in range(100):
            yield b' , "user": "' + b"x" * 100 + b'"'
        yield b"}"

    counted = client.post("/v1/completions", content=chunks(), headers=JSON)
    assert openai_error(counted, 413)["code"] == "request_too_large"
    inspect = client.post("/v1/inspect", json={"prompt": "x" * 5000})
    assert openai_error(inspect, 413)["code"] == "request_too_large"
    still_serves(client)


NOT_JSON = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
            "application/jsonx"]  # fmt: skip


@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_body_that_is_not_declared_json_is_415(client, content_type):
    """A page on another site may POST `text/plain` or a form without a preflight; JSON needs one."""
    headers = {} if content_type is None else {"content-type": content_type}
    for path in ("/v1/completions", "/v1/inspect"):
        response = client.post(path, content=json.dumps(GOOD).encode(), headers=headers)
        assert openai_error(response, 415)["code"] == "unsupported_media_type"
    assert client.post("/v1/completions", content=json.dumps(GOOD), headers={
        "content-type": "Application/JSON; charset=utf-8"}).status_code == 200  # fmt: skip


@pytest.mark.parametrize("host", ["evil.example", "localhost.evil.example", "10.0.0.7:8000", "127.0.0.2"])
def test_a_foreign_host_is_refused_and_this_machine_names_are_answered(client, host):
    """A DNS-rebinding page reaches the port under its own name: refused by default."""
    refused = client.post("/v1/completions", json=GOOD, headers={"host": host})
    assert "Invalid host header" in openai_error(refused, 400)["message"]
    assert client.get("/v1/models", headers={"host": host}).status_code == 400
    for name in ("localhost", "127.0.0.1:8000", "[::1]:8000"):
        still_serves(client, host=name)


def test_an_api_key_is_required_as_a_bearer_token(run):
    with TestClient(app_for(run, slots=4, api_key="s3cret"), base_url=LOCAL) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):  # fmt: skip
            for method, path in (("post", "/v1/completions"), ("get", "/v1/models"), ("post", "/v1/inspect"),
                                 ("get", "/v1/card")):  # fmt: skip
                response = getattr(c, method)(path, headers=headers)
                assert openai_error(response, 401)["code"] == "invalid_api_key"
                assert response.headers["www-authenticate"] == "Bearer"
        assert c.get("/").status_code == 200 and c.get("/page/app.js").status_code == 200
        still_serves(c, authorization="Bearer s3cret")


def test_the_openai_client_sends_the_api_key(run):
    openai = pytest.importorskip("openai")
    with LiveServer(app_for(run, slots=4, api_key="k-123")) as live:
        good = openai.OpenAI(base_url=f"{live.url}/v1", api_key="k-123", max_retries=0)
        assert good.completions.create(model="tiny", prompt="A", max_tokens=2).choices[0].text
        bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


BAD_BODIES = [
    ('{"model": "tiny", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", None),
    ('{"model": "tiny", "prompt": [' + "1" * 5000 + "]}", None),
    ('{"model": "tiny", "prompt": "x", "temperature": ' + "9" * 39 + "}", "temperature"),
    ('{"model": "tiny", "prompt": "x", "top_p": ' + "9" * 39 + "}", "top_p"),
    ('{"model": "tiny", "prompt": "x", "temperature": ' + "9" * 400 + "}", None),  # past a float
    ('{"model": "tiny", "prompt": "x", "temperature": 1e400}', "temperature"),
    ("[" * 100_000 + "]" * 100_000, None),
    ('{"model": "tiny", "prompt": "x", "user": ' + "[" * 20 + "]" * 20 + "}", None),
    ('{"model": "tiny", "prompt": "x", "\\udc00": 1}', None),
    ('{"model": "tiny", "prompt": "x\\ud800y", "echo": true, "max_tokens": 2}', None),
    ('{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', None),
    ('{"model": "tiny", "prompt": "x", "stop": "' + "s" * (MAX_STOP_CHARS + 1) + '"}', "stop"),
]


@pytest.fixture(scope="module")
def roomy(run):
    """A server with the default body limit, whose faults come back as responses (not raised)."""
    with TestClient(app_for(run, slots=4), base_url=LOCAL, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bodies_that_once_gave_a_500_are_a_400_in_openai_json(roomy, body, param):
    response = roomy.post("/v1/completions", content=body.encode(), headers=JSON)
    error = openai_error(response, 400, param)
    assert len(error["message"]) < 300
    still_serves(roomy)


def test_inspect_refuses_a_position_past_the_text(client):
    body = {"prompt": "ROMEO:", "layer": 0, "head": 0}
    assert client.post("/v1/inspect", json={**body, "position": 5}).json()["position"] == 5
    for position in (6, 40, 10**30):
        openai_error(client.post("/v1/inspect", json={**body, "position": position}), 400, "position")
    long = client.post("/v1/inspect", json={**body, "prompt": "x" * 50, "position": 31})  # cropped to 32
    assert long.status_code == 200
    openai_error(
        client.post("/v1/inspect", json={**body, "prompt": "x" * 50, "position": 32}), 400, "position"
    )


def test_too_many_samples_are_refused_before_any_prompt_is_encoded(client):
    server = client.app.state.server  # type: ignore[attr-defined]
    real, calls = server.tokenizer.encode, []
    server.tokenizer.encode = lambda text: calls.append(text) or real(text)
    try:
        many = client.post("/v1/completions", json={**GOOD, "prompt": ["x"] * 200})
        assert "200 prompt(s)" in openai_error(many, 400, "prompt")["message"]
        openai_error(client.post("/v1/completions", json={**GOOD, "prompt": ["x"] * 2, "n": 5}), 400, "n")
        assert calls == []
    finally:
        server.tokenizer.encode = real


class CountingBytes:
    """A byte-level tokenizer (ids 0-255 are bytes) that counts the ids it decodes."""

    vocab_size = 256

    def __init__(self):
        self.decoded = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = list(ids)
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])


def test_a_long_choice_is_decoded_and_searched_in_time_linear_in_its_length():
    tokenizer = CountingBytes()
    text = ChoiceText(tokenizer, stops=["x" * MAX_STOP_CHARS, "never"])
    out = "".join(text.add(Token(ord("ab"[i % 2]), -1.0, [])) for i in range(4000)) + text.finish()
    assert out == "ab" * 2000 and tokenizer.decoded < 10 * 4000  # the whole text each time: 8 million


def test_stop_strings_are_found_across_tokens_and_characters_split_across_tokens():
    tokenizer = CountingBytes()
    text = ChoiceText(tokenizer, stops=["é!"], logprobs=1)
    pieces = [text.add(Token(b, -1.0, [(b, -1.0)])) for b in "café! more".encode()]
    assert "".join(pieces) == "caf" and text.stopped
    drawn = text.logprobs or {}  # every token drawn, up to the stop
    assert drawn["tokens"] == ["c", "a", "f", "bytes:\\xc3", "bytes:\\xa9", "!"]
    assert drawn["text_offset"] == [0, 1, 2, 3, 3, 4]  # the two bytes of one character share its offset
    assert (text.final_logprobs() or {})["tokens"] == ["c", "a", "f"]  # those of the text returned


class HighBytes(CountingBytes):
    """The tiny run's 65 ids as bytes: 0-25 are "A"-"Z", the rest bytes 0x9a-0xc0, which are not
    text alone and all decode to U+FFFD."""

    vocab_size = 65

    def encode(self, text: str) -> list[int]:
        return [b - 0x41 for b in text.encode("ascii")]

    def decode(self, ids) -> str:
        return bytes(self.token_bytes(i)[0] for i in ids).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([0x41 + token if token < 26 else 0x80 + token])


def test_top_logprobs_name_byte_tokens_so_none_merge(run):
    """Most of the model's likely tokens are bytes that all decode to U+FFFD: keyed by that text,
    they merged into one key (fewer than 5 entries)."""
    model, _, _ = load_model(run, kind="GPT")  # the same shapes as `client`'s: its programs serve
    with TestClient(create_app(model, HighBytes(), name="bytes", slots=4), base_url=LOCAL) as c:
        body = {"model": "bytes", "prompt": "AB", "max_tokens": 20, "logprobs": 5, "seed": 1}
        logprobs = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    tops = logprobs["top_logprobs"]
    assert all(len(top) == 5 for top in tops)
    keys = {k for top in tops for k in top}
    assert any(k.startswith("bytes:\\x") for k in keys) and "\ufffd" not in keys


def test_a_request_sent_in_part_is_closed_at_the_deadline_and_a_leaver_logs_nothing(run, caplog):
    caplog.set_level(logging.WARNING)
    # A short deadline, so that the test waits little (it was 1 s), with a margin for a loaded machine
    # to read the whole requests below (and the oversized headers) before it.
    with LiveServer(app_for(run, slots=4), limits=Limits(request_timeout_s=0.5)) as live:
        partial = [
            b"",  # connects, sends nothing
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # half the headers
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model"',  # half the body
        ]
        # All three at once, so the test waits out one deadline rather than three in turn.
        sockets = [socket.create_connection(("127.0.0.1", live.port), timeout=15) for _ in partial]
        try:
            starts = []
            for s, sent in zip(sockets, partial, strict=True):
                s.sendall(sent)
                starts.append(time.monotonic())
            for s, start in zip(sockets, starts, strict=True):
                assert s.recv(4096) == b"" and time.monotonic() - start < 5  # closed, unanswered
        finally:
            for s in sockets:
                s.close()
        with socket.create_connection(
            ("127.0.0.1", live.port), timeout=15
        ) as s:  # headers past 16 KiB, unended
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000)
            assert s.recv(4096).startswith(b"HTTP/1.1 400")
        with socket.create_connection(("127.0.0.1", live.port), timeout=15) as s:  # leaves mid-body
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                      b"\r\nContent-Length: 100\r\n\r\n{\"mo")  # fmt: skip
        time.sleep(0.5)
        import httpx

        assert httpx.post(f"{live.url}/v1/completions", json=GOOD, timeout=60).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_echo_with_logprobs_of_a_prompt_past_the_context_lines_up_with_its_text(client):
    prompt = "ROMEO: " * 7  # 49 characters, past the 32-token context
    body = {**GOOD, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert "".join(lp["tokens"][: len(prompt)]) == prompt and lp["text_offset"][:49] == list(range(49))
    assert lp["token_logprobs"][: 49 - 31] == [None] * 18 and None not in lp["token_logprobs"][18:]


def test_a_fault_of_the_server_is_a_500_in_openai_json(roomy, monkeypatch):
    monkeypatch.setattr("eqx_gpt.serve.api.model_card", lambda *a: 1 / 0)
    response = roomy.get("/v1/card")
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    still_serves(roomy)


def test_inspections_at_once_are_bounded_with_a_429(client):
    server = client.app.state.server  # type: ignore[attr-defined]
    server.inspecting = 2  # two passes running
    try:
        busy = client.post("/v1/inspect", json={"prompt": "ROMEO:"})
        assert openai_error(busy, 429)["code"] == "inspect_busy" and busy.headers["retry-after"] == "1"
    finally:
        server.inspecting = 0
    assert client.post("/v1/inspect", json={"prompt": "ROMEO:"}).status_code == 200


def test_a_path_with_an_encoded_surrogate_is_a_404_in_openai_json(client):
    openai_error(client.get("/v1/%ED%A0%80"), 404)


def test_serving_beyond_loopback_without_a_key_warns_and_loopback_answers_only_its_names(
    run, capsys, monkeypatch
):
    from eqx_gpt.commands import serve as serve_command
    from eqx_gpt.serve import http_server

    served = []
    monkeypatch.setattr(http_server, "serve", lambda app, **kw: served.append((app, kw)))
    monkeypatch.delenv(serve_command.API_KEY_VARIABLE, raising=False)
    assert serve_command.main(["--checkpoint", str(run), "--host", "0.0.0.0", "--port", "0"]) == 0
    err = capsys.readouterr().err
    assert "warning: listening on 0.0.0.0 without an API key" in err and "--api-key" in err
    monkeypatch.setenv(serve_command.API_KEY_VARIABLE, "from-env")
    assert serve_command.main(["--checkpoint", str(run), "--host", "0.0.0.0", "--port", "0"]) == 0
    assert "warning" not in capsys.readouterr().err
    with TestClient(served[-1][0], base_url="http://192.168.1.5") as c:  # any name, but the key
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"authorization": "Bearer from-env"}).status_code == 200
    assert serve_command.allowed_hosts("127.0.0.1") == ["127.0.0.1", "[::1]", "localhost"]
    assert serve_command.allowed_hosts("::1") == ["127.0.0.1", "[::1]", "localhost"]
    assert serve_command.allowed_hosts("10.1.2.3") == ["*"]
    assert serve_command.main(["--checkpoint", str(run), "--api-key", " "]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.gpt2_bpe
def test_incremental_decoding_of_gpt2_tokens_gives_the_whole_text():
    from eqx_gpt.tokenizer import GPT2Tokenizer

    tokenizer = GPT2Tokenizer()
    text = "Ünïcödé — 日本語のテキスト 🎭🎭 and “quotes”, then plain words. " * 3
    ids = tokenizer.encode(text)
    choice = ChoiceText(tokenizer, stops=[], logprobs=1)
    out = "".join(choice.add(Token(i, -1.0, [(i, -1.0)])) for i in ids) + choice.finish()
    assert out == text and tokenizer.decode(ids) == text
    pieces = (choice.logprobs or {})["tokens"]
    assert any(p.startswith("bytes:\\x") for p in pieces)  # the emoji's and CJK's partial tokens
    offsets = (choice.logprobs or {})["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
