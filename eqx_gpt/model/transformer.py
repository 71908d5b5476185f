"""The encoder-decoder Transformer of "Attention Is All You Need" (section 3), built from our parts.

source ids -> `embed * sqrt(d_model)` + sinusoidal positions -> encoder `Block`s (self-attention
that ignores source padding) -> memory
target ids -> `embed * sqrt(d_model)` + positions -> decoder `Block`s (causal self-attention, then
cross-attention to the memory) -> `@ head` -> logits

With the paper's defaults the blocks are post-norm with `LayerNorm` ("Add & Norm"); pre-norm
stacks get a final norm on each side. Its decoder side follows `eqx_gpt.Decoder` once bound to
encoded sources (`Transformer.bind`, a `BoundDecoder`), so `translate` samples through `generate`'s
own KV-cached loop.
"""

import math
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from eqx_gpt._checks import is_whole, takes_token_ids, typechecked
from eqx_gpt.configs import DictConfig, check_fields
from eqx_gpt.errors import ConfigError
from eqx_gpt.model.attention import KVCache, causal_mask, padding_mask
from eqx_gpt.model.block import Block
from eqx_gpt.model.config import NORM_KINDS, NORM_POSITIONS
from eqx_gpt.model.dropout import dropout, dropout_active
from eqx_gpt.model.linear import Linear
from eqx_gpt.model.norm import LayerNorm, RMSNorm, make_norm
from eqx_gpt.model.positions import sinusoidal_positions
from eqx_gpt.model.stack import LayerStack
from eqx_gpt.streams import keys_per_sequence, split_key


@dataclass(frozen=True)
class TransformerConfig(DictConfig):
    """Sizes of an encoder-decoder. `pad_id` marks padding in both vocabularies; `max_len` bounds
    source and target lengths (the positions table). Invalid values raise `ValueError`."""

    src_vocab_size: int
    tgt_vocab_size: int
    max_len: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    d_hidden: int | None = None
    dropout: float = 0.0
    norm: str = "layer"
    norm_position: str = "post"
    norm_eps: float = 1e-5
    pad_id: int = 0

    def __post_init__(self):
        if self.d_hidden is None:
            object.__setattr__(self, "d_hidden", 4 * self.d_model)
        sizes = ("src_vocab_size", "tgt_vocab_size", "max_len", "d_model", "n_heads", "d_hidden")
        check_fields(
            self, positive=(*sizes, "n_encoder_layers", "n_decoder_layers"), finite=("dropout", "norm_eps")
        )
        if self.d_model % self.n_heads or self.d_model % 2:
            raise ConfigError(
                f"TransformerConfig: d_model={self.d_model} must be even and divisible by n_heads"
            )
        if not 0.0 <= self.dropout < 1.0 or not self.norm_eps > 0:
            raise ConfigError(f"TransformerConfig: need 0 <= dropout < 1, norm_eps > 0, got {self.dropout}")
        if self.norm not in NORM_KINDS or self.norm_position not in NORM_POSITIONS:
            raise ConfigError(f"TransformerConfig: norm in {NORM_KINDS}, norm_position in {NORM_POSITIONS}")
        if not 0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size):
            raise ConfigError(f"TransformerConfig.pad_id={self.pad_id} is not an id of both vocabularies")


# The layers' steps for `LayerStack.run`, at module level so that a layer scan compiles once per
# structure and shapes even when the model is called outside `jax.jit` (see eqx_gpt/model/stack.py).


def _encoder_forward(block: Block, x, key, *, mask, inference):
    return block(x, mask=mask, key=key, inference=inference), None


def _decoder_forward(block: Block, x, key, *, memory, mask, context_mask, inference):
    return block(x, memory, mask=mask, context_mask=context_mask, key=key, inference=inference), None


def _cross_kv(block: Block, memory, _):
    return memory, block.cross_sublayer()[1].project_kv(memory)


def _decoder_decode(block: Block, x, per_layer, *, start, context_mask):
    cache, kv = per_layer
    return block.decode(x, cache, start, kv, context_mask)


def _decoder_cross_weights(block: Block, x, _, *, memory, mask, context_mask):
    weights = block.cross_attention_weights(x, memory, mask=mask, context_mask=context_mask)
    return block(x, memory, mask=mask, context_mask=context_mask, inference=True), weights


class Transformer(eqx.Module):
    """An encoder-decoder transformer on one (source, target) pair of id sequences, or a batch.

    Dropout follows `eqx.nn.Dropout`'s contract, as in `GPT`: built in training mode, a call with
    `config.dropout > 0` needs a `key`; `eqx.nn.inference_mode(model)` switches the model and
    every block to inference mode, and `inference=` overrides the modes for one call.
    """

    src_embed: Float[Array, "src_vocab d_model"]
    tgt_embed: Float[Array, "tgt_vocab d_model"]
    encoder: LayerStack  # of Blocks
    decoder: LayerStack  # of Blocks with cross-attention
    encoder_norm: RMSNorm | LayerNorm | None  # pre-norm only: the blocks' output is not normalised
    decoder_norm: RMSNorm | LayerNorm | None
    head: Linear  # d_model -> tgt_vocab
    inference: bool  # the embeddings' dropout; each block holds its own
    config: TransformerConfig = eqx.field(static=True)

    def __init__(self, config: TransformerConfig, *, key: PRNGKeyArray, inference: bool = False):
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"Transformer takes a TransformerConfig, got {type(config).__name__}")
        c = self.config = config
        d_hidden = c.d_hidden if c.d_hidden is not None else 4 * c.d_model  # set by TransformerConfig
        k_src, k_tgt, k_enc, k_dec, k_head = jax.random.split(key, 5)
        self.src_embed = jax.random.normal(k_src, (c.src_vocab_size, c.d_model)) / math.sqrt(c.d_model)
        self.tgt_embed = jax.random.normal(k_tgt, (c.tgt_vocab_size, c.d_model)) / math.sqrt(c.d_model)

        def make_block(cross: bool):
            return lambda k: Block(
                c.d_model, c.n_heads, d_hidden, key=k, dropout=c.dropout, norm_eps=c.norm_eps,
                norm=c.norm, norm_position=c.norm_position, cross_attention=cross, inference=inference,
            )  # fmt: skip

        self.encoder = LayerStack(make_block(False), jax.random.split(k_enc, c.n_encoder_layers))
        self.decoder = LayerStack(make_block(True), jax.random.split(k_dec, c.n_decoder_layers))
        pre = c.norm_position == "pre"
        self.encoder_norm = make_norm(c.norm, c.d_model, c.norm_eps) if pre else None
        self.decoder_norm = make_norm(c.norm, c.d_model, c.norm_eps) if pre else None
        self.head = Linear(c.d_model, c.tgt_vocab_size, key=k_head)
        self.inference = inference

    def _embed(self, table, ids, positions, key, inference: bool):
        x = table[ids] * math.sqrt(self.config.d_model) + positions
        return dropout(x, self.config.dropout, key, inference=inference)

    def _keys(self, key, ids, inference: bool | None):
        """`(own mode, embedding key, layers' key)` of a call on `ids`; training mode with dropout
        and no key raises."""
        own = self.inference if inference is None else inference
        dropout_active(self.config.dropout, own, key, "Transformer")
        if key is None:
            return own, None, None
        k_embed, k_layers = split_key(keys_per_sequence(key, ids.shape[:-1]), 2)
        return own, k_embed, k_layers

    def _check(self, ids, what: str) -> None:
        if ids.shape[-1] > self.config.max_len:
            raise ConfigError(
                f"Transformer got a {what} of {ids.shape[-1]} tokens but max_len={self.config.max_len}; "
                f"shorten it or build the model with a larger max_len"
            )

    @takes_token_ids(src="src_vocab_size")
    @typechecked
    def encode(
        self,
        src: Int[Array, "*batch src_seq"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch src_seq d_model"]:
        """The memory: every source position after the encoder. Padding (`pad_id`) is invisible.
        `key` and `inference` as in `__call__`."""
        self._check(src, "source")
        c, seq = self.config, src.shape[-1]
        own, k_embed, k_layers = self._keys(key, src, inference)
        x = self._embed(self.src_embed, src, sinusoidal_positions(seq, c.d_model), k_embed, own)
        mask = padding_mask(tokens=src, pad_id=c.pad_id)[..., None, :]  # every query sees the real keys
        layer_keys = None if k_layers is None else split_key(k_layers, c.n_encoder_layers)
        layer = eqx.Partial(_encoder_forward, mask=mask, inference=inference)
        x, _ = self.encoder.run(layer, x, layer_keys)
        return x if self.encoder_norm is None else self.encoder_norm(x)

    def _decode_whole(
        self,
        tgt: Int[Array, "*batch tgt_seq"],
        memory: Float[Array, "*batch src_seq d_model"],
        src: Int[Array, "*batch src_seq"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch tgt_seq tgt_vocab"]:
        """Next-token logits for every target position at once (teacher forcing), attending
        causally to the target and to the memory of `src` (whose padding is hidden)."""
        self._check(tgt, "target")
        c, seq = self.config, tgt.shape[-1]
        own, k_embed, k_layers = self._keys(key, tgt, inference)
        x = self._embed(self.tgt_embed, tgt, sinusoidal_positions(seq, c.d_model), k_embed, own)
        mask, context_mask = causal_mask(seq), padding_mask(tokens=src, pad_id=c.pad_id)[..., None, :]
        layer_keys = None if k_layers is None else split_key(k_layers, c.n_decoder_layers)
        layer = eqx.Partial(
            _decoder_forward, memory=memory, mask=mask, context_mask=context_mask, inference=inference
        )
        x, _ = self.decoder.run(layer, x, layer_keys)
        return self.head(x if self.decoder_norm is None else self.decoder_norm(x))

    @takes_token_ids(src="src_vocab_size", tgt="tgt_vocab_size")
    @typechecked
    def __call__(
        self,
        src: Int[Array, "*batch src_seq"],
        tgt: Int[Array, "*batch tgt_seq"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch tgt_seq tgt_vocab"]:
        """Logits `(tgt_seq, tgt_vocab)` for `tgt` given `src` (teacher forcing: position t sees
        target tokens 0..t and the whole source). In training mode with `config.dropout > 0` a
        `key` is required; `inference=True` or `False` overrides the modes for this call."""
        own = self.inference if inference is None else inference
        dropout_active(self.config.dropout, own, key, "Transformer")
        k_enc, k_dec = (None, None) if key is None else split_key(keys_per_sequence(key, src.shape[:-1]), 2)
        memory = self.encode(src, key=k_enc, inference=inference)
        return self._decode_whole(tgt, memory, src, key=k_dec, inference=inference)

    def init_cache(self, batch: int, capacity: int) -> KVCache | tuple[KVCache, ...]:
        """An empty self-attention `KVCache` for every decoder layer and `batch` target rows, of
        `capacity` positions: keys `(n_layers, batch, n_heads, d_head, capacity)`."""
        c = self.config
        if not is_whole(capacity, 1, c.max_len) or not is_whole(batch, 1):
            raise ConfigError(f"init_cache needs batch >= 1 and capacity in [1, max_len={c.max_len}]")
        empty = lambda layers: KVCache.zeros((*layers, batch), c.n_heads, c.d_model // c.n_heads, capacity)
        return self.decoder.per_layer(empty)

    def memory_kv(self, memory: Float[Array, "batch src_seq d_model"]):
        """Each decoder layer's cross-attention keys and values of `memory` (from `encode`): what
        every decoding step attends to, projected once per source."""
        _, kv = self.decoder.run(_cross_kv, memory)
        return kv

    def decode(
        self,
        tgt: Int[Array, "*batch new"],
        cache: KVCache | tuple[KVCache, ...],
        start: Int[Array, ""] | int,
        memory_kv,
        src: Int[Array, "*batch src_seq"],
    ) -> tuple[Float[Array, "*batch new tgt_vocab"], KVCache | tuple[KVCache, ...]]:
        """Logits for the target tokens `tgt` at positions `start, ..., start + new - 1`, reading
        and updating the decoder's self-attention `cache` (from `init_cache`) and attending to the
        source through `memory_kv` (from `memory_kv(encode(src))`; `src` hides its padding).

        Equal (up to float rounding) to the last `new` rows of `__call__(src, target so far)`, but
        costs only the new positions: `GPT.decode`'s meaning, for the encoder-decoder. Decoding
        is inference: it never drops out."""
        c = self.config
        capacity = self.decoder.first(cache).v.shape[-2]
        table = sinusoidal_positions(capacity, c.d_model)
        positions = jax.lax.dynamic_slice_in_dim(table, start, tgt.shape[-1])
        x = self._embed(self.tgt_embed, tgt, positions, None, True)
        context_mask = padding_mask(tokens=src, pad_id=c.pad_id)[..., None, :]
        layer = eqx.Partial(_decoder_decode, start=jnp.asarray(start), context_mask=context_mask)
        stacked = isinstance(cache, KVCache)  # a stacked decoder's cache, else one per layer
        per_layer = (cache, memory_kv) if stacked else tuple(zip(cache, memory_kv, strict=True))
        x, cache = self.decoder.run(layer, x, per_layer)
        return self.head(x if self.decoder_norm is None else self.decoder_norm(x)), cache

    @takes_token_ids(src="src_vocab_size")
    def bind(self, src: Int[Array, "batch src_seq"]) -> "BoundDecoder":
        """The decoder side bound to the sources `src` `(batch, src_seq)`: a `BoundDecoder`, which
        follows `eqx_gpt.Decoder` (`generate` samples targets from it, one row per source). The
        sources are encoded, and each decoder layer's cross keys and values projected, once here."""
        if src.ndim != 2:
            raise ValueError(f"bind takes sources of shape (batch, src_seq), got {tuple(src.shape)}")
        model = eqx.nn.inference_mode(self)
        model = eqx.tree_at(lambda m: m.decoder, model, model.decoder.unstack())
        return BoundDecoder(model, model.memory_kv(model.encode(src)), src)

    @takes_token_ids(src="src_vocab_size", tgt="tgt_vocab_size")
    @typechecked
    def cross_attention_weights(
        self, src: Int[Array, " src_seq"], tgt: Int[Array, " tgt_seq"]
    ) -> Float[Array, "layers heads tgt_seq src_seq"]:
        """Every decoder layer's and head's cross-attention weights (target rows, source columns)."""
        c, memory = self.config, self.encode(src, inference=True)
        x = self._embed(self.tgt_embed, tgt, sinusoidal_positions(tgt.shape[-1], c.d_model), None, True)
        mask, context_mask = causal_mask(tgt.shape[-1]), padding_mask(tokens=src, pad_id=c.pad_id)[None, :]
        layer = eqx.Partial(_decoder_cross_weights, memory=memory, mask=mask, context_mask=context_mask)
        _, weights = self.decoder.run(layer, x)
        return self.decoder.as_array(weights)


class BoundDecoder(eqx.Module):
    """A `Transformer`'s decoder side bound to encoded sources (`Transformer.bind`): an
    `eqx_gpt.Decoder` over target ids, so `generate` and its relatives sample from it.

    Row `r` of a batch decodes against source `r`: `init_cache(batch=...)` takes the number of
    sources, and a single row (`tokens` `(new,)`, one row's cache) is source 0 of one. The cache is
    a tuple of per-layer self-attention `KVCache`s (the decoder unstacked: a token's work reads each
    weight once), of `context_length = max_len` positions.
    """

    model: Transformer  # in inference mode, its decoder unstacked
    memory_kv: tuple  # each decoder layer's cross-attention (keys, values) of the sources
    src: Int[Array, "batch src_seq"]  # the sources, whose padding cross-attention hides

    @property
    def context_length(self) -> int:
        """The most target positions: the model's `max_len`."""
        return self.model.config.max_len

    @property
    def vocab_size(self) -> int:
        """The target vocabulary's size."""
        return self.model.config.tgt_vocab_size

    def init_cache(self, *, batch: int) -> tuple[KVCache, ...]:
        """An empty cache for `batch` target rows, one per bound source."""
        if batch != self.src.shape[0]:
            raise ValueError(
                f"this decoder is bound to {self.src.shape[0]} source(s); decode that many target rows, "
                f"got batch={batch}"
            )
        cache = self.model.init_cache(batch, self.model.config.max_len)
        assert isinstance(cache, tuple)  # the decoder is unstacked
        return cache

    def decode(
        self, tokens: Int[Array, "*batch new"], cache: tuple[KVCache, ...], start: Int[Array, ""] | int
    ) -> tuple[Float[Array, "*batch new tgt_vocab"], tuple[KVCache, ...]]:
        """Logits of target `tokens` at positions `start, ...` given the bound sources (see
        `Transformer.decode`), and the cache updated."""
        memory_kv, src = self.memory_kv, self.src
        if tokens.ndim == 1:  # one row without its batch axis: source 0's
            memory_kv, src = jax.tree.map(lambda a: a[0], (memory_kv, src))
        logits, updated = self.model.decode(tokens, cache, start, memory_kv, src)
        assert isinstance(updated, tuple)  # the decoder is unstacked
        return logits, updated
