"""Serving a decoder of the user's own, end to end: a RoPE + gated-MLP decoder built only from
eqx_gpt's public parts (`RMSNorm`, `MultiHeadAttention(rope=True)`, `KVCache`, `Linear`), behind
`create_app`: seeded completions equal `generate`'s tokens, continuous batching, the page's
attention found by type; a decoder without eqx_gpt's attention gets the next-token view and the
reason its heatmap is absent; a decoder whose logits are NaN fails its request in OpenAI's JSON."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from eqx_gpt import (  # noqa: E402
    CharTokenizer,
    Decoder,
    KVCache,
    Linear,
    MultiHeadAttention,
    RMSNorm,
    SamplingOptions,
    create_app,
    generate,
)

pytestmark = pytest.mark.xdist_group("serve")

TEXT = "the quick brown fox jumps over the lazy dog. THE END!\n"
LOCAL = "http://localhost"  # a name of this machine: the app answers no other Host by default
TOKENIZER = CharTokenizer.from_text(TEXT)


class GatedBlock(eqx.Module):
    """Pre-norm RoPE self-attention and a SwiGLU feed-forward of its own."""

    attn_norm: RMSNorm
    attn: MultiHeadAttention
    mlp_norm: RMSNorm
    gate: Linear
    up: Linear
    down: Linear

    def __init__(self, d: int, n_heads: int, *, key):
        ka, kg, ku, kd = jax.random.split(key, 4)
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.attn = MultiHeadAttention(d, n_heads, key=ka, rope=True)
        self.gate, self.up, self.down = (
            Linear(d, 2 * d, key=kg),
            Linear(d, 2 * d, key=ku),
            Linear(2 * d, d, key=kd),
        )

    def decode(self, x, cache: KVCache, start):
        h, cache = self.attn.decode(self.attn_norm(x), cache, start)
        x = x + h
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h)), cache


class OwnDecoder(eqx.Module):
    """Token embeddings, `GatedBlock`s in a Python loop, a norm and an untied head."""

    embed: jax.Array
    blocks: tuple[GatedBlock, ...]
    norm: RMSNorm
    head: Linear
    vocab_size: int = eqx.field(static=True)
    context_length: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)

    def __init__(self, vocab_size: int, *, d: int = 32, n_heads: int = 4, n_layers: int = 2,
                 context_length: int = 16, key):  # fmt: skip
        ke, kb, kh = jax.random.split(key, 3)
        self.embed = jax.random.normal(ke, (vocab_size, d)) * 0.3
        self.blocks = tuple(GatedBlock(d, n_heads, key=k) for k in jax.random.split(kb, n_layers))
        self.norm = RMSNorm(d)
        self.head = Linear(d, vocab_size, key=kh, init_std=0.3)
        self.vocab_size, self.context_length, self.n_heads = vocab_size, context_length, n_heads

    def init_cache(self, *, batch: int) -> tuple[KVCache, ...]:
        d_head = self.embed.shape[1] // self.n_heads
        return tuple(KVCache.zeros((batch,), self.n_heads, d_head, self.context_length) for _ in self.blocks)

    def decode(self, tokens, cache, start):
        x, updated = self.embed[tokens], []
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x, layer_cache = block.decode(x, layer_cache, start)
            updated.append(layer_cache)
        return self.head(self.norm(x)), tuple(updated)


class Bigram(eqx.Module):
    """A decoder with no attention at all: the next token's logits from the last token alone."""

    table: jax.Array
    vocab_size: int = eqx.field(static=True)
    context_length: int = eqx.field(static=True)

    def __init__(self, vocab_size: int, *, key, scale: float = 3.0):
        self.table = jax.random.normal(key, (vocab_size, vocab_size)) * scale
        self.vocab_size, self.context_length = vocab_size, 16

    def init_cache(self, *, batch: int):
        return jnp.zeros((batch, 1))

    def decode(self, tokens, cache, start):
        return self.table[tokens], cache


@pytest.fixture(scope="module")
def decoder() -> OwnDecoder:
    model: Decoder = OwnDecoder(TOKENIZER.vocab_size, key=jax.random.key(0))  # pyright checks the protocol
    assert isinstance(model, OwnDecoder)
    return model


@pytest.fixture(scope="module")
def client(decoder):
    with TestClient(create_app(decoder, TOKENIZER, name="own", slots=3, queue_size=16), base_url=LOCAL) as c:
        yield c


def complete(client, **body) -> dict:
    response = client.post("/v1/completions", json={"model": "own", **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_seeded_request_gives_generates_tokens(client, decoder):
    # 40 tokens past a 16-token context: the window slides (cut and re-prefilled) in both. No filter:
    # the filters act on logits alike for every decoder (test_serve.py checks them against sample.py),
    # and with them `generate` and the server compile each of their programs once more.
    settings: dict = dict(temperature=1.5)
    prompt = "the fox"
    answer = complete(client, prompt=prompt, max_tokens=40, seed=11, n=2, **settings)
    for j, choice in enumerate(answer["choices"]):
        key = jax.random.fold_in(jax.random.key(11), j)  # sample j of seed 11, as sample.py draws it
        ids = generate(decoder, TOKENIZER.encode(prompt), 40, key=key, options=SamplingOptions(**settings))
        assert choice["text"] == TOKENIZER.decode(ids.tolist())
    assert answer["choices"][0]["text"] != answer["choices"][1]["text"]
    greedy = generate(decoder, TOKENIZER.encode(prompt), 30, key=jax.random.key(0), temperature=0)
    assert complete(client, prompt=prompt, max_tokens=30, temperature=0)["choices"][0]["text"] == (
        TOKENIZER.decode(greedy.tolist())
    )


def test_requests_share_the_slots_and_each_gets_its_own_tokens(client, decoder):
    """More samples than slots: they queue, join the batch as slots free, and each still draws
    `generate`'s tokens for its key."""
    answer = complete(client, prompt="dog", max_tokens=20, seed=5, n=7, temperature=1.0)
    for j, choice in enumerate(answer["choices"]):
        ids = generate(decoder, TOKENIZER.encode("dog"), 20, key=jax.random.fold_in(jax.random.key(5), j))
        assert choice["text"] == TOKENIZER.decode(ids.tolist())
    assert client.app.state.server.batcher.steps > 0  # type: ignore[attr-defined]


@eqx.filter_jit  # one program: run eagerly, each of its operations compiled one of its own
def layer_1_weights(decoder: OwnDecoder, tokens):
    """`(heads, n, n)`: the attention weights of `decoder`'s layer 1 on its own input, by its parts."""
    x = decoder.blocks[0].decode(decoder.embed[tokens], KVCache.zeros((), 4, 8, 16), 0)[0]
    block = decoder.blocks[1]
    return block.attn.weights(block.attn_norm(x), mask=jnp.tril(jnp.ones((len(tokens),) * 2, bool)))


def test_the_page_finds_its_attention_by_type(client, decoder):
    card = client.get("/v1/card").json()
    assert card["attention"] == {"layers": 2, "heads": 4, "absent": None}
    assert card["config"] == {"class": "OwnDecoder", "context_length": 16, "vocab_size": TOKENIZER.vocab_size}
    seen = client.post("/v1/inspect", json={"prompt": "lazy dog", "layer": 1, "head": 3}).json()
    attention = np.asarray(seen["attention"])
    assert attention.shape == (8, 8) and seen["attention_absent"] is None
    np.testing.assert_allclose(attention.sum(axis=1), 1.0, atol=1e-3)
    assert np.all(np.triu(attention, 1) == 0)  # causal
    # The weights are layer 1's, head 3's: those of its attention on its own input.
    tokens = jax.device_put(np.asarray(TOKENIZER.encode("lazy dog"), np.int32))
    expected = np.asarray(layer_1_weights(decoder, tokens))[3]  # NumPy's indexing: JAX's compiles
    np.testing.assert_allclose(attention, expected, atol=2e-4)
    for field, value in (("layer", 2), ("position", 8)):  # 2 layers; 8 tokens, positions 0..7
        bad = client.post("/v1/inspect", json={"prompt": "lazy dog", field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field


def test_attention_through_the_api_is_found_by_type_too(client, decoder):
    """The own decoder's attention at each generated token, through `/v1/completions`: the rows of
    `/v1/inspect` on the whole text, and the tokens those of the same request without it."""
    body = dict(prompt="lazy dog", max_tokens=6, seed=3, temperature=1.0)
    plain = complete(client, **body)["choices"][0]
    choice = complete(client, **body, attention={"layers": [1], "heads": [3, 0]})["choices"][0]
    assert choice["text"] == plain["text"] and choice["attention"]["start"] == [0] * 6
    seen = client.post("/v1/inspect", json={"prompt": "lazy dog" + choice["text"], "layer": 1, "head": 0})
    for k, rows in enumerate(choice["attention"]["weights"]):
        head_0 = rows[0][1]  # layer 1, head 0: the second head asked
        np.testing.assert_allclose(head_0, seen.json()["attention"][8 + k - 1][: 8 + k], atol=6e-5)


def test_a_decoder_without_eqx_gpts_attention_gets_the_next_token_view_and_the_reason():
    with TestClient(
        create_app(Bigram(TOKENIZER.vocab_size, key=jax.random.key(1)), TOKENIZER), base_url=LOCAL
    ) as c:
        assert (
            c.get("/v1/card")
            .json()["attention"]["absent"]
            .startswith("Bigram has no eqx_gpt MultiHeadAttention")
        )
        seen = c.post("/v1/inspect", json={"prompt": "the", "temperature": 0}).json()
        assert (
            seen["attention"] is None
            and "Bigram has no eqx_gpt MultiHeadAttention" in seen["attention_absent"]
        )
        after = seen["next_token"]["after"]
        assert after[0]["prob"] == 1.0  # greedy: all the mass on the argmax
        table = np.asarray(Bigram(TOKENIZER.vocab_size, key=jax.random.key(1)).table)
        assert after[0]["id"] == int(np.argmax(table[TOKENIZER.encode("e")[0]]))
        text = c.post("/v1/completions", json={"model": "eqx_gpt", "prompt": "the", "max_tokens": 5}).json()[
            "choices"
        ][0]["text"]
        assert len(text) == 5
        asked = {"model": "eqx_gpt", "prompt": "the", "attention": {"layers": [0], "heads": [0]}}
        error = c.post("/v1/completions", json=asked).json()["error"]
        assert (
            error["param"] == "attention" and "Bigram has no eqx_gpt MultiHeadAttention" in (error["message"])
        )


def test_a_request_whose_logits_hold_nan_fails_alone_in_openais_json(decoder):
    head = np.array(decoder.head.weight)  # NumPy: an eager `.at[].set` compiles a program
    head[0, 0] = np.nan
    broken = eqx.tree_at(lambda m: m.head.weight, decoder, jax.device_put(head))
    with TestClient(create_app(broken, TOKENIZER, slots=3), base_url=LOCAL) as c:
        response = c.post(
            "/v1/completions", json={"model": "eqx_gpt", "prompt": "dog", "max_tokens": 5, "temperature": 0}
        )
        assert response.status_code == 500
        error = response.json()["error"]
        assert "NaN" in error["message"] and error["type"] == "server_error"
        stream = c.post(
            "/v1/completions", json={"model": "eqx_gpt", "prompt": "dog", "max_tokens": 5, "stream": True}
        ).text
        assert "NaN" in stream and stream.endswith("data: [DONE]\n\n")
        seen = c.post("/v1/inspect", json={"prompt": "dog"})
        assert seen.status_code == 500 and "NaN" in seen.json()["error"]["message"]
        assert c.get("/v1/models").status_code == 200  # still serving


def test_the_guides_decoder_is_served_as_the_guide_serves_it():
    from doc_blocks import DOCS, block_under

    namespace: dict = {}
    for heading in ("### Sample from a decoder of your own", "### Serving your own model"):
        exec(compile(block_under(DOCS[1], heading), str(DOCS[1]), "exec"), namespace)
    decoder, tokenizer = namespace["decoder"], namespace["tokenizer"]
    with TestClient(namespace["app"], base_url=LOCAL) as c:
        assert c.get("/v1/card").json()["attention"] == {"layers": 2, "heads": 4, "absent": None}
        body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 24, "seed": 3, "temperature": 0.8}
        text = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        key = jax.random.fold_in(jax.random.key(3), 0)
        assert text == tokenizer.decode(
            generate(decoder, tokenizer.encode("ROMEO:"), 24, key=key, temperature=0.8).tolist()
        )
        assert len(c.post("/v1/inspect", json={"prompt": "ROMEO:"}).json()["attention"]) == 6


class WideLogits(Bigram):
    """A decoder whose logits are wider than its vocabulary: ids past it could be drawn."""

    def decode(self, tokens, cache, start):
        return jnp.pad(self.table[tokens], [(0, 0)] * tokens.ndim + [(0, 4)]), cache


class NewCache(Bigram):
    """A decoder that hands back a cache of another shape than it took."""

    def decode(self, tokens, cache, start):
        return self.table[tokens], jnp.zeros((*cache.shape[:-1], 2))


@pytest.mark.parametrize(
    "decoder, match",
    [
        (WideLogits, r"WideLogits.decode returned logits of shape \(1, 16, 39\).*vocab_size=35"),
        (NewCache, "NewCache.decode returned its cache in another form than it took"),
    ],
)
def test_a_decoder_breaking_the_contract_is_refused_when_the_app_is_made(decoder, match):
    with pytest.raises(TypeError, match=match):
        create_app(decoder(TOKENIZER.vocab_size, key=jax.random.key(0)), TOKENIZER)


class Traced(OwnDecoder):
    """An `OwnDecoder` that counts the times its `decode` is traced, in `TRACED`."""

    def decode(self, tokens, cache, start):
        TRACED.append(tokens.shape)
        return super().decode(tokens, cache, start)


TRACED: list[tuple[int, ...]] = []


def test_a_start_traces_each_check_once_and_a_second_start_of_the_same_structure_none():
    """A server's start traces the decode once per check (the batcher's contract, the attention
    layers, the lens's streams and its tail), and a second server of a model of the same structure
    (other weights) none again, with the same layouts: JAX keeps the traces."""
    first = create_app(Traced(TOKENIZER.vocab_size, key=jax.random.key(5)), TOKENIZER, slots=3)
    assert len(TRACED) == 4
    TRACED.clear()
    second = create_app(Traced(TOKENIZER.vocab_size, key=jax.random.key(6)), TOKENIZER, slots=3)
    assert TRACED == []
    for app in (first, second):
        server = app.state.server
        assert (server.layout.n_layers, server.layout.n_heads, server.layout.absent) == (2, 4, None)
        assert (server.lens.n_layers, server.lens.absent) == (2, None)
