"""Many LoRA adapters in one server: `eqx-gpt serve --adapter NAME=DIR`, a request's `model` picking
one, requests for different adapters decoded in the same batched steps, each seeded request giving
the tokens of its model alone, and the command's one-line refusals."""

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("starlette")
from serve_fixtures import SHAKESPEARE, query_rows, zero_gpt  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from eqx_gpt import (  # noqa: E402
    GPT,
    CharTokenizer,
    GPTConfig,
    LoRALinear,
    SamplingOptions,
    apply_lora,
    choose_adapter,
    create_app,
    generate,
    load_adapters,
    load_model,
    merge_lora,
    save_adapters,
    save_checkpoint,
    stack_adapters,
    train,
)
from eqx_gpt.commands import serve as serve_command  # noqa: E402
from eqx_gpt.generation.decoding import prefill  # noqa: E402
from eqx_gpt.serve.batcher import Finished, Sequence, Token, sample_key_data  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve")
LOCAL = "http://localhost"
TOKENIZER = CharTokenizer.from_text(SHAKESPEARE)
CONFIG = GPTConfig(vocab_size=TOKENIZER.vocab_size, context_length=32, d_model=32, n_heads=4, n_layers=2)
# Two adapters unlike each other: ranks, targets and alphas differ (the bank pads and scales each).
ADAPTERS = {"poet": (1, 4, 16.0, "c_attn"), "lawyer": (2, 8, 8.0, "c_attn,c_fc")}


def adapted(base, seed: int, rank: int, alpha: float, targets: str):
    """`base` with LoRA adapters whose B is random (a fresh adapter's B is zero: the base itself)."""
    model = apply_lora(base, rank, alpha=alpha, targets=targets, key=jax.random.key(seed))
    is_lora = lambda n: isinstance(n, LoRALinear)
    lora_bs = lambda m: [n.lora_b for n in jax.tree.leaves(m, is_leaf=is_lora) if is_lora(n)]
    rng = np.random.default_rng(seed + 100)  # NumPy: JAX's draws compile a program per shape
    drawn = [jax.device_put(4.0 * rng.standard_normal(b.shape, np.float32)) for b in lora_bs(model)]
    return eqx.tree_at(lora_bs, model, drawn)


def zero_adapted(config: GPTConfig, rank: int, alpha: float, targets: str):
    """`apply_lora` of a GPT of `config`, its arrays NumPy zeros, made from its shapes alone: for a
    test of what an adapter's shapes are refused for (nothing compiled to make it)."""
    lora = lambda: apply_lora(zero_gpt(config), rank, alpha=alpha, targets=targets, key=jax.random.key(0))
    zeros = lambda s: np.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s
    return jax.tree.map(zeros, eqx.filter_eval_shape(lora))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The base's run folder and each adapter's PEFT folder (written by `save_adapters`)."""
    root = tmp_path_factory.mktemp("adapters")
    base = GPT(CONFIG, key=jax.random.key(0))
    (root / "base").mkdir()
    save_checkpoint(root / "base", "best", base, None, step=1, tokenizer=TOKENIZER, train_config={})
    for name, (seed, rank, alpha, targets) in ADAPTERS.items():
        save_adapters(adapted(base, seed, rank, alpha, targets), root / name, base="tiny-base")
    return root


@pytest.fixture(scope="module")
def models(folders):
    """`{name: model}`: the base ("tiny") and each adapter read back from its folder onto it."""
    base, _, _ = load_model(folders / "base", kind="GPT")  # as `eqx-gpt serve --checkpoint` reads it
    return {"tiny": base, **{name: load_adapters(base, folders / name, dropout=0.0) for name in ADAPTERS}}


@pytest.fixture(scope="module")
def client(models):
    adapters = {name: models[name] for name in ADAPTERS}
    app = create_app(models["tiny"], TOKENIZER, name="tiny", slots=4, queue_size=16, adapters=adapters)
    with TestClient(app, base_url=LOCAL) as c:
        yield c


def alone(model, prompt: str, tokens: int, seed: int, temperature: float) -> str:
    """What `generate` draws for sample 0 of a seeded request, on `model` alone (adapters unmerged)."""
    key = jax.random.wrap_key_data(jax.device_put(sample_key_data(seed, 0)))
    ids = generate(model, TOKENIZER.encode(prompt), tokens, key=key, temperature=temperature)
    return TOKENIZER.decode([int(t) for t in ids])


def test_models_lists_the_base_and_every_adapter_and_an_unknown_model_is_404(client):
    listed = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "poet", "lawyer"]
    assert [m.get("parent") for m in listed] == [None, "tiny", "tiny"]
    assert client.get("/v1/card").json()["adapters"] == ["poet", "lawyer"]  # the page's card too
    for path in ("/v1/completions", "/v1/inspect"):
        answer = client.post(path, json={"model": "novelist", "prompt": "A"})
        error = answer.json()["error"]
        assert answer.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert "'tiny', 'poet', 'lawyer'" in error["message"]


def test_concurrent_requests_to_three_models_each_give_their_model_alone(client, models):
    """Requests to the base and both adapters at once (threads): each seeded text is what `generate`
    draws on that model alone; 40 tokens past a 32-token context slide the window too."""
    prompt, tokens, temperature = "KING:", 40, 0.8
    bodies = [
        {"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": temperature, "seed": seed}
        for seed in (3, 4)
        for name in models
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: client.post("/v1/completions", json=b).json(), bodies))
    for body, answer in zip(bodies, answers, strict=True):
        assert answer["model"] == body["model"]
        expected = alone(models[body["model"]], prompt, tokens, body["seed"], temperature)
        assert answer["choices"][0]["text"] == expected, body
    texts = [a["choices"][0]["text"] for a in answers[:3]]
    assert len(set(texts)) == 3  # the adapters change what is drawn: the check above could fail


def test_sequences_for_different_adapters_share_every_decode_step(client, models):
    """Three sequences (base, poet, lawyer) submitted at once decode together: `tokens - 1` decode
    steps for all (the first token is their prefill's), not three times that; greedy, each gives its
    model's tokens alone."""
    batcher = client.app.state.server.batcher  # type: ignore[attr-defined]
    prompt, tokens = TOKENIZER.encode("ROMEO:"), 12
    drawn = {i: [] for i in range(3)}
    done = threading.Semaphore(0)

    def emit(i):
        def on(event):
            if isinstance(event, Token):
                drawn[i].append(event.id)
            elif isinstance(event, Finished):
                done.release()

        return on

    greedy = SamplingOptions(temperature=0.0)
    sequences = [
        Sequence(prompt, tokens, greedy, sample_key_data(0, 0), emit(i), adapter=i) for i in range(3)
    ]
    steps = batcher.steps
    batcher.submit(sequences)
    for _ in sequences:
        assert done.acquire(timeout=120)
    assert batcher.steps - steps == tokens - 1
    for i, name in enumerate(models):
        key = jax.random.key(0)
        assert drawn[i] == [int(t) for t in generate(models[name], prompt, tokens, key=key, temperature=0.0)]


@eqx.filter_jit  # one program for every adapter index (a jit made per call would compile it per call)
def _adapter_logits(model, tokens, index):
    return prefill(choose_adapter(model, index), tokens)[0]


def test_an_adapter_stacked_computes_its_model_alone_and_merged_within_rounding(models):
    """Adapter i of the stack: the very logits of its model with the adapters apart (the same
    arithmetic), and those of its merged model within float32 rounding."""
    names = list(ADAPTERS)
    stacked = eqx.nn.inference_mode(stack_adapters(models["tiny"], [models[n] for n in names], names))
    tokens = jax.device_put(np.asarray(TOKENIZER.encode("To be, or not to be"), np.int32)[None])
    run = lambda m, i: _adapter_logits(m, tokens, i)
    for i, name in enumerate(["tiny", *names]):
        own = eqx.nn.inference_mode(models[name])
        logits = np.asarray(run(stacked, jnp.int32(i)))
        np.testing.assert_array_equal(logits, np.asarray(eqx.filter_jit(prefill)(own, tokens)[0]))
        merged = np.asarray(eqx.filter_jit(prefill)(merge_lora(own), tokens)[0])
        np.testing.assert_allclose(logits, merged, rtol=0, atol=1e-4)
    base = np.asarray(run(stacked, jnp.int32(0)))
    assert np.abs(np.asarray(run(stacked, jnp.int32(1))) - base).max() > 1e-2  # an adapter does change them


def test_attention_through_the_api_is_each_models_own(client, models):
    """`attention` asked of the base and of an adapter at once: each token's rows are those of a
    forward pass of that model (merged) over the text its window held."""
    ask = {"layers": [0, 1], "heads": [2]}
    bodies = [{"model": name, "prompt": "ROMEO:", "max_tokens": 10, "temperature": 1.0, "seed": 1,
               "attention": ask} for name in ("tiny", "poet")]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda b: client.post("/v1/completions", json=b).json(), bodies))
    rows_of = {}
    for body, answer in zip(bodies, answers, strict=True):
        choice, model = answer["choices"][0], merge_lora(eqx.nn.inference_mode(models[body["model"]]))
        text = TOKENIZER.encode("ROMEO:" + choice["text"])
        attention = choice["attention"]
        for k, (start, rows) in enumerate(zip(attention["start"], attention["weights"], strict=True)):
            expected = query_rows(model, text, start, len("ROMEO:") + k - 1)[:, 2]  # layers 0 and 1, head 2
            np.testing.assert_allclose(np.asarray(rows)[:, 0], expected, atol=1e-5)
        rows_of[body["model"]] = choice["attention"]["weights"][0]
    assert rows_of["tiny"] != rows_of["poet"]  # the adapter changes the attention: the check could fail


def test_inspect_takes_the_model_so_the_page_compares_base_and_adapter(client):
    body = {"prompt": "ROMEO:", "temperature": 1.0}
    base = client.post("/v1/inspect", json=body).json()["next_token"]["before"]
    assert client.post("/v1/inspect", json={**body, "model": "tiny"}).json()["next_token"]["before"] == base
    poet = client.post("/v1/inspect", json={**body, "model": "poet"}).json()["next_token"]["before"]
    assert poet != base


def refused(argv, capsys, *phrases) -> None:
    try:
        code = serve_command.main(argv)
    except SystemExit as e:  # a flag argparse refuses
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("eqx-gpt serve: error:"), err
    assert all(p in err for p in phrases), err


def test_the_command_refuses_bad_adapters_in_one_line(folders, tmp_path, capsys):
    base = ["--checkpoint", str(folders / "base"), "--name", "tiny"]
    poet = f"poet={folders / 'poet'}"
    refused([*base, "--adapter", "poet"], capsys, "NAME=DIR")
    refused([*base, "--adapter", f"=x{folders}"], capsys, "NAME=DIR")
    refused([*base, "--adapter", f"po et={folders / 'poet'}"], capsys, "name 'po et'")
    refused([*base, "--adapter", poet, "--adapter", poet], capsys, "'poet' is given twice")
    refused([*base, "--adapter", f"tiny={folders / 'poet'}"], capsys, "base model's name")
    refused([*base, "--adapter", f"x={tmp_path}"], capsys, "not an adapter folder")
    refused([*base, "--adapter", f"x={folders / 'base'}"], capsys, "a run without LoRA adapters")
    # Adapters of a wider model, and of a deeper one: for another base.
    wider, deeper = dataclasses.replace(CONFIG, d_model=64), dataclasses.replace(CONFIG, n_layers=3)
    for other, phrase in ((wider, "another model"), (deeper, "layer 2")):
        model = zero_adapted(other, 4, 16.0, "c_attn")
        save_adapters(model, tmp_path / "other", base="other")
        refused([*base, "--adapter", f"other={tmp_path / 'other'}"], capsys, "--adapter other=", phrase)


TINY_GPT2 = Path(__file__).resolve().parent / "fixtures" / "tiny-gpt2"
PEFT_FIXTURE = TINY_GPT2.parent / "tiny-gpt2-lora"  # written by Hugging Face PEFT itself


@pytest.mark.slow  # a LoRA training run of GPT-2, then two servers; the tests above serve adapters quickly
def test_a_lora_run_and_a_peft_folder_served_on_their_gpt2_and_the_run_alone_as_today(gpt2_corpus, tmp_path):
    """`--adapter` takes a LoRA run's folder and a folder PEFT wrote, on the GPT-2 folder they adapt:
    each seeded request gives its adapter's model alone (`load_model(run, lora="separate")`,
    `load_adapters`). The run served as `--checkpoint` (merged, alone) still gives its own tokens."""
    settings = dict(context_length=32, batch_size=2, eval_batches=1, max_steps=3, eval_interval=3,
                    warmup_steps=1, lr=1e-2, lora_rank=4, lora_alpha=8.0,
                    lora_targets="c_attn,c_proj")  # fmt: skip
    train(out_dir=tmp_path / "run", init_from=str(TINY_GPT2), data=str(gpt2_corpus), sample_tokens=0,
          log=lambda s: None, progress=False, **settings)  # fmt: skip
    base, tokenizer, _ = load_model(TINY_GPT2, kind="GPT")
    given = [("run", tmp_path / "run"), ("peft", PEFT_FIXTURE)]
    adapters = serve_command.load_served_adapters(base, "tiny-gpt2", given)
    alone_models = {
        "run": load_model(tmp_path / "run", lora="separate")[0],
        "peft": load_adapters(base, PEFT_FIXTURE),
    }
    merged, _, _ = load_model(tmp_path / "run", kind="GPT")  # what `--checkpoint RUN` serves
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0.9, "seed": 5}
    key = jax.random.wrap_key_data(jax.device_put(sample_key_data(5, 0)))
    drawn = lambda m: tokenizer.decode([int(t) for t in generate(m, [5, 6, 7], 12, key=key, temperature=0.9)])
    app = create_app(base, tokenizer, name="tiny-gpt2", slots=4, adapters=adapters)
    with TestClient(app, base_url=LOCAL) as client:
        for name, model in alone_models.items():
            answer = client.post("/v1/completions", json={**body, "model": name}).json()
            assert answer["choices"][0]["text"] == drawn(model), name
    with TestClient(create_app(merged, tokenizer, name="run", slots=4), base_url=LOCAL) as client:
        answer = client.post("/v1/completions", json={**body, "model": "run"}).json()
        assert answer["choices"][0]["text"] == drawn(merged)


def test_adapters_of_a_model_of_ones_own_in_eqx_gpts_format_batch_too(tmp_path):
    """A decoder of one's own (its blocks a tuple), its adapters in eqx_gpt's own format: served
    beside it, each seeded request gives the adapted model's tokens alone."""
    from test_serve_own_decoder import TOKENIZER as OWN_TOKENIZER
    from test_serve_own_decoder import OwnDecoder

    own = OwnDecoder(OWN_TOKENIZER.vocab_size, key=jax.random.key(0))
    save_adapters(adapted(own, 3, 4, 16.0, "attn.qkv,up"), tmp_path / "own-lora", base="tests:OwnDecoder")
    adapters = serve_command.load_served_adapters(own, "own", [("mine", tmp_path / "own-lora")])
    app = create_app(own, OWN_TOKENIZER, name="own", slots=4, adapters=adapters)
    key = jax.random.wrap_key_data(jax.device_put(sample_key_data(2, 0)))
    with TestClient(app, base_url=LOCAL) as client:
        texts = {}
        for name, model in (("own", own), ("mine", adapters["mine"])):
            body = {"model": name, "prompt": "the fox", "max_tokens": 20, "temperature": 0.9, "seed": 2}
            texts[name] = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            ids = generate(model, OWN_TOKENIZER.encode("the fox"), 20, key=key, temperature=0.9)
            assert texts[name] == OWN_TOKENIZER.decode([int(t) for t in ids]), name
    assert texts["own"] != texts["mine"]
