"""A bounded load test on loopback: 64 concurrent clients, a third of them sending bad requests or
leaving mid-stream, and among them hostile ones (a cross-site `text/plain` POST, a DNS-rebinding
`Host`, oversized bodies, half-sent headers); every good request is answered in full and every
slot is freed after. Then `eqx-gpt serve` itself under SIGTERM, once and twice: every stream ends
with a final event within the documented bound and the process exits."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
from serve_fixtures import LiveServer, app_for, free_port, make_run  # noqa: E402

from eqx_gpt.serve.http_server import FINAL_EVENTS_S, Limits  # noqa: E402

pytestmark = pytest.mark.slow
CLIENTS = 64
TOKENS = 24
TIMEOUT_S = 120  # per request; the pool below is bounded by CLIENTS requests
REQUEST_TIMEOUT_S = 2.0  # the deadline the half-sent requests meet
MAX_BODY = 8192


def good(url: str, i: int) -> str:
    """A good request (half streamed); retries a 429 after its Retry-After, at most 20 times."""
    body = {
        "model": "tiny",
        "prompt": f"Client {chr(65 + i % 26)}:",
        "max_tokens": TOKENS,
        "seed": i,
        "stream": i % 2 == 0,
    }
    for _ in range(20):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            if r.status_code == 429:
                time.sleep(float(r.headers["retry-after"]))
                continue
            assert r.status_code == 200
            if not body["stream"]:
                r.read()
                return r.json()["choices"][0]["text"]
            lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            return "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1])
    raise AssertionError("still busy after 20 tries")


def bad(url: str, i: int) -> str:
    body = [{"model": "tiny", "prompt": "x", "temperature": -1}, {"model": "nope", "prompt": "x"}][i % 2]
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] in ("temperature", "model")
    return "bad"


def leaver(url: str, i: int) -> str:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5000, "stream": True, "seed": i}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        if r.status_code == 429:
            return "left"
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then hang up
    return "left"


def cross_site(url: str, i: int) -> str:
    """What a page on another site can send without a preflight: text/plain or a form."""
    kind = ["text/plain", "application/x-www-form-urlencoded"][i % 2]
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4})
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": kind}, timeout=TIMEOUT_S)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    return "refused"


def rebinding(url: str, i: int) -> str:
    """A DNS-rebinding page: this port, under the attacker's name."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    r = httpx.post(
        f"{url}/v1/completions", json=body, headers={"host": "attacker.example"}, timeout=TIMEOUT_S
    )
    assert r.status_code == 400
    return "refused"


def oversized(url: str, i: int) -> str:
    """A body over the limit: declared (refused from its Content-Length) or streamed (counted)."""
    prompt = "x" * (MAX_BODY * 4)
    if i % 2:
        body = json.dumps({"model": "tiny", "prompt": prompt}).encode()
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=TIMEOUT_S)  # fmt: skip
    else:
        chunks = (prompt[j : j + 1024].encode() for j in range(0, len(prompt), 1024))
        r = httpx.post(f"{url}/v1/completions", content=chunks, headers={"content-type": "application/json"},
                       timeout=TIMEOUT_S)  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    return "refused"


def slow_header(url: str, i: int) -> str:
    """Half a request's headers, then nothing: closed at the deadline, unanswered."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        start = time.monotonic()
        assert s.recv(1024) == b""
        assert time.monotonic() - start < REQUEST_TIMEOUT_S + 5
    return "closed"


HOSTILE = [bad, leaver, cross_site, rebinding, oversized, slow_header]


def test_64_clients_a_third_bad_hostile_or_leaving_lose_no_good_request(tmp_path):
    app = app_for(make_run(tmp_path), slots=8, queue_size=32, max_body_bytes=MAX_BODY)
    with LiveServer(app, limits=Limits(request_timeout_s=REQUEST_TIMEOUT_S)) as live:
        kinds = [HOSTILE[(i // 3) % len(HOSTILE)] if i % 3 == 1 else good for i in range(CLIENTS)]
        assert sum(k is not good for k in kinds) >= CLIENTS // 3 - 1
        start = threading.Barrier(CLIENTS)

        def client(i):
            start.wait(timeout=TIMEOUT_S)
            return kinds[i](live.url, i)

        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(client, range(CLIENTS)))
        assert all(
            r == "refused" for r, k in zip(results, kinds, strict=True) if k in (cross_site, rebinding)
        )
        texts = [r for r, k in zip(results, kinds, strict=True) if k is good]
        assert len(texts) == sum(k is good for k in kinds) and all(len(t) == TOKENS for t in texts)
        batcher = live.app.state.server.batcher
        for _ in range(300):  # bounded: 30 s for the leavers' slots to be freed
            if batcher.live == 0 and batcher.waiting == 0:
                break
            time.sleep(0.1)
        assert batcher.live == 0 and batcher.waiting == 0
        # and it still serves, with the seeded text a client got under load
        assert good(live.url, 3) == texts[[i for i, k in enumerate(kinds) if k is good].index(3)]


def start_serving(run, port: int, *flags: str) -> subprocess.Popen:
    """`eqx-gpt serve` in its own process, once it answers (bounded: 180 s)."""
    serve = ["serve", "--checkpoint", str(run), "--name", "tiny", "--port", str(port), *flags]
    command = [sys.executable, "-m", "eqx_gpt", *serve]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    for _ in range(1800):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.1)
    process.kill()
    raise AssertionError("eqx-gpt serve did not start in 180 s")


def stream_events(url: str, max_tokens: int, seed: int, started: threading.Event, events: list) -> None:
    """Read one stream's events (JSON, or "[DONE]") into `events`, setting `started` at the first."""
    body = {"model": "tiny", "prompt": "KING:", "max_tokens": max_tokens, "seed": seed, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_ends_every_stream_with_a_final_event_within_the_bound_and_exits(tmp_path, signals):
    grace = 0.5  # a 10-token stream ends well within it, a 4000-token one (seconds here) does not
    run, port = make_run(tmp_path), free_port()
    process = start_serving(run, port, "--shutdown-timeout", str(grace), "--slots", "4")
    url = f"http://127.0.0.1:{port}"
    try:
        # Warm up (compile) so that a short stream surely ends within the grace.
        warm = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "K", "max_tokens": 40},
            timeout=TIMEOUT_S,
        )
        assert warm.status_code == 200, warm.text
        plans = {"short": 10, "long-1": 4000, "long-2": 4000}
        streams = {name: ([], threading.Event()) for name in plans}
        threads = [
            threading.Thread(target=stream_events, args=(url, n, i, streams[name][1], streams[name][0]))
            for i, (name, n) in enumerate(plans.items())
        ]
        for t in threads:
            t.start()
        assert all(started.wait(TIMEOUT_S) for _, started in streams.values())
        whole = {}
        waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": "K", "max_tokens": 4000}, timeout=TIMEOUT_S)))  # fmt: skip
        waiting.start()
        time.sleep(0.5)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        if signals == 2:
            time.sleep(0.3)
            process.send_signal(signal.SIGTERM)
        bound = (grace if signals == 1 else 0.3) + FINAL_EVENTS_S + 1
        for t in [*threads, waiting]:
            t.join(timeout=bound + 30)
        ended = time.monotonic() - sent
        assert ended < bound + 2, f"the streams took {ended:.1f} s to end"
        with pytest.raises(httpx.TransportError):  # no longer admitting
            httpx.get(f"{url}/v1/models", timeout=5)
        process.wait(timeout=30)
    finally:
        process.kill()
    stderr = process.communicate()[1]
    assert "Traceback" not in stderr, stderr
    short, _ = streams["short"]
    assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
    assert len("".join(e["choices"][0]["text"] for e in short[:-1])) == 10  # finished within the grace
    for name in ("long-1", "long-2"):
        events, _ = streams[name]
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
    assert whole["r"].status_code == 503 and whole["r"].json()["error"]["code"] == "server_shutting_down"
