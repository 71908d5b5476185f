"""A bounded load test on loopback: 64 concurrent clients, a third of them sending bad requests or
leaving mid-stream; every good request is answered in full and every slot is freed after."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
from serve_fixtures import LiveServer, app_for, make_run  # noqa: E402

pytestmark = pytest.mark.slow
CLIENTS = 64
TOKENS = 24
TIMEOUT_S = 120  # per request; the pool below is bounded by CLIENTS requests


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


def test_64_clients_a_third_bad_or_leaving_lose_no_good_request(tmp_path):
    app = app_for(make_run(tmp_path), slots=8, queue_size=32)
    with LiveServer(app) as live:
        kinds = [(bad if i % 6 == 1 else leaver if i % 6 == 4 else good) for i in range(CLIENTS)]
        assert sum(k is not good for k in kinds) >= CLIENTS // 3 - 1
        start = threading.Barrier(CLIENTS)

        def client(i):
            start.wait(timeout=TIMEOUT_S)
            return kinds[i](live.url, i)

        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(client, range(CLIENTS)))
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
