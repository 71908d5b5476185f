"""`eqx-gpt serve --follow`: the run's newest checkpoint swapped in as it lands, between two decode
steps, a sequence in flight drawing all its tokens; requests after it on the new weights; a
checkpoint of another model refused with the reason; `/v1/run` telling the page; the command's
refusal of a folder that is not a run."""

import dataclasses
import threading

import jax
import pytest

pytest.importorskip("starlette")
from serve_fixtures import app_for, make_run, zero_gpt  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from eqx_gpt import GPT, generate, load_model, save_checkpoint  # noqa: E402
from eqx_gpt.commands import serve as serve_command  # noqa: E402
from eqx_gpt.generation.sampling import SamplingOptions  # noqa: E402
from eqx_gpt.serve.batcher import Failed, Finished, Sequence, Token, sample_key_data  # noqa: E402
from eqx_gpt.serve.follow import newest_checkpoint  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")
LOCAL = "http://localhost"


def write(run, model, step: int, tokenizer) -> None:
    save_checkpoint(run, "latest", model, None, step=step, tokenizer=tokenizer, train_config={})


def test_follow_swaps_in_each_new_checkpoint_without_dropping_a_request(tmp_path):
    run = make_run(tmp_path)
    served, tokenizer, _ = load_model(run, kind="GPT")
    newer = GPT(served.config, key=jax.random.key(1))
    app = app_for(run, slots=4, follow=run, follow_every_s=3600)  # looked at by hand below
    with TestClient(app, base_url=LOCAL) as c:
        server = app.state.server
        state = c.get("/v1/run").json()
        assert (state["step"], state["following"], state["loaded"], state["error"]) == (20, True, 0, None)
        assert state["curve"]["val"] == [[10, 3.8], [20, 3.4]]
        before = c.post("/v1/inspect", json={"prompt": "ROMEO:"}).json()["next_token"]["before"]

        # A sequence in flight when the checkpoint lands: written and swapped in at its 3rd token.
        events, done = [], threading.Event()

        def emit(event):
            events.append(event)
            if len(events) == 3:
                write(run, newer, 30, tokenizer)
                assert server.follower.check()
            if isinstance(event, Finished | Failed):
                done.set()

        prompt = tokenizer.encode("ROMEO:")
        server.batcher.submit([Sequence(prompt, 40, SamplingOptions(), sample_key_data(0, 0), emit)])
        assert done.wait(120)
        assert [type(e) for e in events] == [Token] * 40 + [Finished] and events[-1].reason == "length"

        state = c.get("/v1/run").json()
        assert (state["step"], state["checkpoint"], state["loaded"]) == (30, "latest.json", 1)
        assert state["error"] is None
        assert newest_checkpoint(run) == run / "latest.json"  # step 30 against best's 20
        # New requests run on the new weights: a seeded one gives generate's tokens on them.
        body = {"model": "tiny", "prompt": "KING:", "max_tokens": 20, "seed": 7}
        answer = c.post("/v1/completions", json=body).json()
        ids = generate(newer, tokenizer.encode("KING:"), 20, key=jax.random.fold_in(jax.random.key(7), 0))
        assert answer["choices"][0]["text"] == tokenizer.decode(ids.tolist())
        after = c.post("/v1/inspect", json={"prompt": "ROMEO:"}).json()["next_token"]["before"]
        assert after != before

        # Another model written into the folder is not swapped in; the reason is told.
        other = zero_gpt(dataclasses.replace(served.config, d_model=64))  # its shape is what counts
        write(run, other, 40, tokenizer)
        assert not server.follower.check()
        state = c.get("/v1/run").json()
        assert state["step"] == 30 and "another model" in state["error"] and "restart" in state["error"]


def test_the_follower_thread_polls_the_run(tmp_path):
    run = make_run(tmp_path)
    served, tokenizer, _ = load_model(run, kind="GPT")
    with TestClient(app_for(run, follow=run, follow_every_s=0.05), base_url=LOCAL) as c:
        write(run, GPT(served.config, key=jax.random.key(5)), 25, tokenizer)
        for _ in range(600):  # bounded: 60 s
            if c.get("/v1/run").json()["step"] == 25:
                break
            threading.Event().wait(0.1)
        assert c.get("/v1/run").json()["loaded"] == 1


def test_a_server_not_following_says_so(tmp_path):
    with TestClient(app_for(make_run(tmp_path)), base_url=LOCAL) as c:
        state = c.get("/v1/run").json()
        assert (state["step"], state["following"], state["error"]) == (20, False, None)


def test_follow_needs_a_run_folder_and_takes_no_adapter(tmp_path, capsys):
    assert serve_command.main(["--checkpoint", str(tmp_path), "--follow"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--follow follows a run folder" in err
    (tmp_path / "run").mkdir()
    run = make_run(tmp_path / "run")
    assert serve_command.main(["--checkpoint", str(run), "--follow", "--adapter", f"poet={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "takes no --adapter" in err
