"""The page's logit lens and all-heads view (`/v1/inspect`): each layer's top tokens equal a forward
pass of the model with the blocks after that layer left out (the public `__call__`, not the lens's
decode path), for GPT's shapes and for a decoder of one's own found by type; a model with no block
says why; every head of a layer comes back over the window asked for."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float, Int
from test_serve_own_decoder import TOKENIZER, Bigram, GatedBlock, OwnDecoder

from eqx_gpt import GPT, CharTokenizer, GPTConfig, KVCache, MultiHeadAttention
from eqx_gpt.serve.inspect import attention_layout, inspect_text
from eqx_gpt.serve.lens import LENS_TOP, lens_layout

pytestmark = pytest.mark.xdist_group("serve")
TEXT = "ROMEO: what light through yonder window breaks"
CHARS = CharTokenizer.from_text(TEXT)
# Every GPT here has this shape (with settings): a model of one shape compiles its programs once.
SHAPE = dict(vocab_size=CHARS.vocab_size, context_length=64, d_model=32, n_heads=4, n_layers=3)


class Skip(eqx.Module):
    """A block left out: the residual stream passes it unchanged."""

    def __call__(self, x, *, mask=None, key=None, inference=None):
        return x


# The references below are jitted, each model's layers in one program: run eagerly, every
# operation of every layer compiled a program of its own.


@eqx.filter_jit
def gpt_through(model: GPT, tokens: Int[Array, " n"]) -> Float[Array, "layers n vocab"]:
    """For each layer, the next-token probabilities of `model` run with its blocks after that
    layer left out."""
    unstacked = model.unstack()
    layers = unstacked.blocks.layers
    through = []
    for layer in range(len(layers)):
        kept = (*layers[: layer + 1], *(Skip() for _ in layers[layer + 1 :]))
        truncated = eqx.tree_at(lambda m: m.blocks.layers, unstacked, kept)
        through.append(jax.nn.softmax(truncated(tokens, inference=True), axis=-1))
    return jnp.stack(through)


@eqx.filter_jit
def own_through(model: OwnDecoder, tokens: Int[Array, " n"]) -> Float[Array, "layers n vocab"]:
    """`gpt_through` of a decoder of one's own, through its blocks' `decode`."""
    x, through = model.embed[tokens][None], []
    for block, cache in zip(model.blocks, model.init_cache(batch=1), strict=True):
        x, _ = block.decode(x, cache, 0)
        through.append(jax.nn.softmax(model.head(model.norm(x))[0], axis=-1))
    return jnp.stack(through)


_attention_weights = eqx.filter_jit(lambda model, tokens: model.attention_weights(tokens))


def on_device(tokens: list[int]) -> jax.Array:
    """`tokens` as an int32 array, put on the device by NumPy (`jnp.asarray` compiles a program)."""
    return jax.device_put(np.asarray(tokens, np.int32))


def lens_of(model, tokenizer, text: str, position: int) -> list[dict]:
    seen = inspect_text(
        model, tokenizer, tokenizer.encode(text), layer=0, head=0, position=position,
        temperature=0.7, top_k=3, top_p=None,
    )  # fmt: skip
    assert seen["lens_absent"] is None
    return seen["lens"]


def assert_lens_is(lens: list[dict], manual: list[np.ndarray]) -> None:
    assert [row["layer"] for row in lens] == list(range(len(manual)))
    for row, probs in zip(lens, manual, strict=True):
        ids = [t["id"] for t in row["top"]]
        shown = np.array([t["prob"] for t in row["top"]])
        assert len(ids) == LENS_TOP
        assert np.allclose(probs[ids], shown, atol=2e-5)  # these tokens, with these probabilities
        assert np.allclose(np.sort(probs)[::-1][:LENS_TOP], shown, atol=2e-5)  # and the top ones


@pytest.mark.parametrize(
    "settings",
    [
        {},  # the default: sinusoidal positions, pre-norm RMSNorm, an untied head, blocks scanned
        dict(positions="learned", bias=True, norm="layer", tie_embeddings=True),  # GPT-2's shape
        dict(norm_position="post", logit_softcap=5.0),  # no final norm; the soft-cap in the tail
    ],
    ids=["default", "gpt2-shape", "post-norm-softcap"],
)
def test_the_lens_of_a_gpt_is_its_forward_pass_with_the_later_blocks_left_out(settings):
    model = GPT(GPTConfig(**SHAPE, **settings), key=jax.random.key(1))
    tokens, position = CHARS.encode(TEXT), 17
    lens = lens_of(model, CHARS, TEXT, position)
    assert_lens_is(lens, list(np.asarray(gpt_through(model, on_device(tokens)))[:, position]))
    # The last layer's lens is the model's own next-token distribution, the "before filters" bars.
    assert lens_layout(model).n_layers == 3


def test_the_lens_of_a_decoder_of_ones_own_finds_its_blocks_by_type():
    # test_serve_own_decoder.py's structure (2 layers): the server's programs for it serve this too.
    model = OwnDecoder(TOKENIZER.vocab_size, key=jax.random.key(2))
    text, position = "the lazy dog", 9
    tokens = TOKENIZER.encode(text)
    lens = lens_of(model, TOKENIZER, text, position)
    assert_lens_is(lens, list(np.asarray(own_through(model, on_device(tokens)))[:, position]))


def test_a_model_without_blocks_gets_no_lens_and_the_reason():
    seen = inspect_text(
        Bigram(TOKENIZER.vocab_size, key=jax.random.key(0)), TOKENIZER, TOKENIZER.encode("dog"),
        layer=0, head=0, position=None, temperature=1.0, top_k=None, top_p=None,
    )  # fmt: skip
    assert seen["lens"] is None and "no block the lens can walk" in seen["lens_absent"]
    assert len(seen["next_token"]["before"]) == 10  # the rest of the page still works


class PairBlock(eqx.Module):
    """A `GatedBlock` whose cache is a `(k, v)` pair: its attention's `KVCache` is not handed back."""

    inner: GatedBlock
    attn: MultiHeadAttention

    def decode(self, x, cache, start):
        x, kv = self.inner.decode(x, KVCache(*cache), start)
        return x, (kv.k, kv.v)


class PairDecoder(OwnDecoder):
    """An `OwnDecoder` of `PairBlock`s, its cache a tuple of pairs."""

    def __init__(self, vocab_size: int, *, key):
        super().__init__(vocab_size, key=key)
        self.blocks = tuple(PairBlock(b, b.attn) for b in self.blocks)  # pyright: ignore[reportAttributeAccessIssue]

    def init_cache(self, *, batch: int):
        return tuple((c.k, c.v) for c in super().init_cache(batch=batch))


def test_a_model_whose_blocks_hide_their_caches_gets_neither_view_and_the_reasons():
    """What the page cannot show is said, found from shapes alone: no recorded attention comes
    back, and the lens cannot record its streams."""
    model = PairDecoder(TOKENIZER.vocab_size, key=jax.random.key(0))
    layout = attention_layout(model)
    assert (
        layout.absent
        == "PairDecoder.decode does not hand back the caches its MultiHeadAttention layers return"
    )
    lens = lens_layout(model)
    assert lens.n_layers == 0 and lens.absent is not None
    assert lens.absent.startswith(
        "PairDecoder's blocks cannot be finished by its own tail (TypeError: PairBlock.decode hands back a "
        "tuple, not a KVCache)"
    )


def test_every_head_of_a_layer_over_the_window_and_the_last_layer_lens_is_the_before_bars():
    model = GPT(GPTConfig(**SHAPE), key=jax.random.key(3))
    tokens = CHARS.encode(TEXT)
    n = len(tokens)
    seen = inspect_text(
        model, CHARS, tokens, layer=1, head=2, position=None, temperature=1.0, top_k=None, top_p=None,
        all_heads=True, window=10,
    )  # fmt: skip
    heads = np.array(seen["heads"])
    assert heads.shape == (4, 10, 10) and seen["window_start"] == n - 10
    whole = np.asarray(_attention_weights(model, on_device(tokens)))[1]  # (heads, n, n)
    assert np.allclose(heads, whole[:, n - 10 :, n - 10 :], atol=1e-3)
    assert np.allclose(seen["attention"], heads[2])
    at = inspect_text(
        model, CHARS, tokens, layer=1, head=2, position=20, temperature=1.0, top_k=None, top_p=None,
        all_heads=True, window=8,
    )  # fmt: skip
    assert at["window_start"] == 13 and np.allclose(at["heads"], whole[:, 13:21, 13:21], atol=1e-3)
    before = seen["next_token"]["before"][:LENS_TOP]
    assert [t["id"] for t in seen["lens"][-1]["top"]] == [t["id"] for t in before]


def test_the_endpoint_takes_all_heads_and_a_window_and_refuses_bad_ones(tmp_path):
    pytest.importorskip("starlette")
    from serve_fixtures import app_for, make_run
    from starlette.testclient import TestClient

    with TestClient(app_for(make_run(tmp_path)), base_url="http://localhost") as c:
        body = {"prompt": "ROMEO: hark", "layer": 1, "head": 3, "all_heads": True, "window": 4}
        seen = c.post("/v1/inspect", json=body).json()
        assert np.array(seen["heads"]).shape == (4, 4, 4) and seen["window_start"] == 7
        assert seen["attention"] == seen["heads"][3] and len(seen["lens"]) == 2
        whole = c.post("/v1/inspect", json={**body, "window": 1000}).json()  # past the text: all of it
        assert whole["window_start"] == 0 and np.array(whole["heads"]).shape == (4, 11, 11)
        for field, value in (("window", 0), ("window", 2.5), ("all_heads", "yes")):
            bad = c.post("/v1/inspect", json={**body, field: value})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field
