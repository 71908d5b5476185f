"""The decoder-only GPT: embeddings, a scanned stack of blocks, and the output projection."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from eqx_gpt._checks import is_traced, is_whole, takes_token_ids, typechecked
from eqx_gpt.model.attention import KVCache, causal_mask
from eqx_gpt.model.block import Block
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.dropout import dropout, dropout_active
from eqx_gpt.model.embedding import embedding_lookup
from eqx_gpt.model.linear import Linear, linear
from eqx_gpt.model.norm import LayerNorm, RMSNorm, make_norm
from eqx_gpt.model.positions import sinusoidal_positions
from eqx_gpt.model.stack import LayerStack
from eqx_gpt.streams import keys_per_sequence, split_key

# The blocks' steps for `LayerStack.run`, at module level so that a layer scan compiles once per
# structure and shapes even when the model is called outside `jax.jit` (see eqx_gpt/model/stack.py).


def _block_forward(block: Block, x, key, *, mask, inference):
    return block(x, mask=mask, key=key, inference=inference), None


def _block_weights(block: Block, x, _, *, mask):
    return block(x, mask=mask, inference=True), block.attention_weights(x, mask=mask)


def _block_decode(block: Block, x, cache, *, start):
    return block.decode(x, cache, start)


class GPT(eqx.Module):
    """A decoder-only transformer language model acting on one sequence of token ids (or a batch).

    tokens -> `embed[tokens] * sqrt(d_model)` + sinusoidal positions -> `n_layers` pre-norm
    causal blocks -> RMSNorm -> `@ head` -> logits.

    That is the default; `GPTConfig` names the other choices. GPT-2 is `positions="learned"`
    (`embed[tokens] + pos_embed[t]`), `bias=True`, `norm="layer"` and `tie_embeddings=True`
    (logits `@ embed.T`, no `head`); `eqx_gpt.gpt2` loads OpenAI's weights into it.

    The blocks are a `LayerStack`: one `Block` whose arrays carry a leading `n_layers` axis, run
    with `jax.lax.scan`, so the compiled program does not grow with depth. (`unstack` gives the
    same model with separate blocks run as a Python loop: faster for decoding one token at a time.)
    The embedding and head have `config.padded_vocab_size` rows/columns; the logits of the padding
    ids are **sliced off**, so `__call__` returns exactly `config.vocab_size` logits per position
    and a padding id can never be predicted or sampled.

    Dropout (`config.dropout`, on the embeddings, each sub-layer's output and the attention
    weights) follows `eqx.nn.Dropout`'s contract. The model is built in training mode
    (`inference=False` here and in every block): with `dropout > 0` a call needs a `key`, and
    without one it raises. `eqx.nn.inference_mode(model)` switches it, and every block, to
    inference mode (no dropout, any key or none); `model(tokens, inference=True)` does so for
    one call. With `dropout == 0` no key is ever needed.
    """

    embed: Float[Array, "padded_vocab d_model"]
    pos_embed: Float[Array, "context d_model"] | None  # positions="learned" only
    blocks: LayerStack  # of Blocks
    final_norm: RMSNorm | LayerNorm | None  # None with post-norm blocks: their output is normed
    head: Linear | None  # d_model -> padded_vocab; None with tie_embeddings: `embed.T`
    inference: bool  # the embeddings' dropout; each block holds its own (`eqx.nn.inference_mode`)
    config: GPTConfig = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray, inference: bool = False):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT takes a GPTConfig, got {type(config).__name__}")
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        c = config
        d_hidden = c.d_hidden if c.d_hidden is not None else 4 * c.d_model  # set by GPTConfig
        self.config = c
        if c.positions == "sinusoidal":
            # Unit-variance token vectors after the sqrt(d_model) scale, comparable to the table.
            self.embed = jax.random.normal(k_embed, (c.padded_vocab_size, c.d_model)) / math.sqrt(c.d_model)
        else:  # GPT-2's initialisation
            self.embed = 0.02 * jax.random.normal(k_embed, (c.padded_vocab_size, c.d_model))
        learned = c.positions == "learned"
        k_pos = jax.random.fold_in(key, 3)  # a fourth key, leaving the default model's draws as they were
        self.pos_embed = 0.02 * jax.random.normal(k_pos, (c.context_length, c.d_model)) if learned else None

        def make_block(k):
            return Block(
                c.d_model, c.n_heads, d_hidden, key=k, dropout=c.dropout, norm_eps=c.norm_eps,
                norm=c.norm, norm_position=c.norm_position, bias=c.bias, activation=c.activation,
                rope=c.positions == "rope", inference=inference,
            )  # fmt: skip

        blocks = LayerStack(make_block, jax.random.split(k_blocks, c.n_layers), unroll=c.scan_unroll)
        # GPT-2's scaled init: each residual branch adds variance, so shrink the projections that
        # write into the residual stream by 1/sqrt(2 * n_layers).
        scale = 0.0 if c.zero_init else 1.0 / math.sqrt(2 * c.n_layers)
        self.blocks = eqx.tree_at(
            lambda s: (s.layers.attn.out.weight, s.layers.mlp.down.weight),
            blocks,
            (blocks.layers.attn.out.weight * scale, blocks.layers.mlp.down.weight * scale),
        )
        self.final_norm = make_norm(c.norm, c.d_model, c.norm_eps) if c.norm_position == "pre" else None
        tied = c.tie_embeddings
        head_std = 0.0 if c.zero_init else 0.02
        self.head = None if tied else Linear(c.d_model, c.padded_vocab_size, key=k_head, init_std=head_std)
        self.inference = inference

    def _embed(self, tokens, start, table_length: int):
        """Token vectors plus the position vectors of positions `start .. start + new - 1`, read
        from a table of `table_length` rows (sinusoidal or learned; none under RoPE)."""
        c = self.config
        # Its gradient reaches the lookup as `compute_dtype` values unless the sinusoidal scale
        # multiplies it first: then it needs float32's bits (`embedding_lookup`).
        sinusoidal = c.positions != "rope" and self.pos_embed is None
        x = embedding_lookup(self.embed, tokens, exact_dtype=jnp.float32 if sinusoidal else c.compute_dtype)
        if c.positions == "rope":  # positions enter in attention
            return x.astype(c.compute_dtype)
        if self.pos_embed is None:  # sinusoidal
            x = x * math.sqrt(c.d_model)
            table = sinusoidal_positions(table_length, c.d_model)
        else:
            table = self.pos_embed
        return (x + jax.lax.dynamic_slice_in_dim(table, start, tokens.shape[-1])).astype(c.compute_dtype)

    @property
    def context_length(self) -> int:
        """`config.context_length`: the most positions a window, and a cache, holds."""
        return self.config.context_length

    @property
    def vocab_size(self) -> int:
        """`config.vocab_size`: the logits per position (the padding ids sliced off)."""
        return self.config.vocab_size

    @property
    def head_weight(self) -> Float[Array, "d_model padded_vocab"]:
        """The output projection's matrix: `head.weight`, or `embed.T` with tied embeddings."""
        return self.embed.T if self.head is None else self.head.weight

    def logits(self, features: Float[Array, "*rows d_model"]) -> Float[Array, "*rows vocab"]:
        """float32 logits of `vocab_size` ids for `features` (from `GPT.features`): the head, the
        padding ids sliced off, then `logit_softcap` if set."""
        projected = linear(features, self.embed.T) if self.head is None else self.head(features)
        logits = projected[..., : self.config.vocab_size].astype(jnp.float32)
        cap = self.config.logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def _normed(self, x):
        return x if self.final_norm is None else self.final_norm(x)

    def _logits(self, x):
        return self.logits(self._normed(x))

    def _check_ids(self, tokens) -> None:
        """Refuse token ids outside `[0, vocab_size)` where they are concrete (not under `jit`).

        Inside `jit` the ids are not known when this runs: there an id past the table reads a
        clamped row (JAX's gather semantics) and a padding id reads an untrained row, so the
        logits are finite but meaningless. `generate` and the CLIs check ids before tracing.
        """
        if is_traced(tokens) or tokens.size == 0:
            return
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(
                f"GPT got token ids from {low} to {high}, outside [0, vocab_size={self.config.vocab_size}); "
                f"encode text with the model's tokenizer"
            )

    def _check_length(self, n: int) -> None:
        if n > self.config.context_length:
            raise ValueError(
                f"GPT got a sequence of {n} tokens but context_length={self.config.context_length}; "
                f"pass at most the last {self.config.context_length} tokens."
            )

    @takes_token_ids(tokens="vocab_size")
    @typechecked
    def __call__(
        self,
        tokens: Int[Array, "*batch seq"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch seq vocab"]:
        """Next-token logits `(seq, vocab_size)` for `tokens` of shape `(seq,)`.

        Position t sees tokens 0..t only (causal). In training mode with `config.dropout > 0`,
        dropout is applied and `key` is required; in inference mode (`eqx.nn.inference_mode`) the
        call is deterministic, whatever the key. `inference=True` or `False` overrides the modes of
        the model and its blocks for this call.

        A batch `(batch, seq)` gives `(batch, seq, vocab_size)`, the same as `jax.vmap` over its
        rows, but faster: every projection is then one matrix multiply for the whole batch. Its
        `key` is one key per sequence, shape `(batch,)` (or one key, split into those).
        """
        return self.logits(self.features(tokens, key=key, inference=inference))

    @takes_token_ids(tokens="vocab_size")
    @typechecked
    def features(
        self,
        tokens: Int[Array, "*batch seq"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """The final hidden states `(seq, d_model)` (after the final norm, in `compute_dtype`) that
        `__call__` turns into logits: `model(tokens) == model.logits(model.features(tokens))`.

        Same arguments as `__call__`. A loss over a large vocabulary takes these and the
        `head_weight` (`eqx_gpt.chunked_cross_entropy`) rather than every logit at once.
        """
        seq = tokens.shape[-1]
        self._check_length(seq)
        self._check_ids(tokens)
        own = self.inference if inference is None else inference
        dropout_active(self.config.dropout, own, key, "GPT")
        k_embed = k_blocks = layer_keys = None
        if key is not None:
            k_embed, k_blocks = split_key(keys_per_sequence(key, tokens.shape[:-1]), 2)
            layer_keys = split_key(k_blocks, self.config.n_layers)
        x = dropout(self._embed(tokens, 0, seq), self.config.dropout, k_embed, inference=own)
        layer = eqx.Partial(_block_forward, mask=causal_mask(seq), inference=inference)
        x, _ = self.blocks.run(layer, x, layer_keys)
        return self._normed(x)

    @takes_token_ids(tokens="vocab_size")
    @typechecked
    def attention_weights(self, tokens: Int[Array, " seq"]) -> Float[Array, "layers heads seq seq"]:
        """Every layer's and head's attention weights for `tokens` (deterministic, no dropout).

        Uses the very attention code of `__call__` (`Block.attention_weights`: what each block
        attends with, in pre-norm and post-norm alike).
        """
        seq = tokens.shape[0]
        self._check_length(seq)
        x = self._embed(tokens, 0, seq)
        _, weights = self.blocks.run(eqx.Partial(_block_weights, mask=causal_mask(seq)), x)
        return self.blocks.as_array(weights)

    def unstack(self) -> "GPT":
        """The same model with its blocks as a tuple of `n_layers` separate `Block`s (a copy).

        Everything works as before; the blocks just run as a Python loop, so compile time grows
        with depth. Use it for decoding one token at a time: there each weight is read once per
        token, and a `scan` over stacked weights first copies every layer's slice, which doubles
        the memory traffic of a step that is bound by memory. The unstacked model's caches
        (`init_cache`, `decode`) are tuples of per-layer `KVCache`s.
        """
        return eqx.tree_at(lambda m: m.blocks, self, self.blocks.unstack())

    def init_cache(
        self, capacity: int | None = None, *, batch: int | None = None
    ) -> KVCache | tuple[KVCache, ...]:
        """An empty `KVCache` for all layers: keys `(n_layers, n_heads, d_head, capacity)`, values
        `(n_layers, n_heads, capacity, d_head)`.

        `capacity` defaults to (and may not exceed) `config.context_length`. With `batch`, there is
        a `batch` axis after the layer axis (for `decode` on a batch of sequences). An unstacked
        model (`unstack`) gets a tuple of `n_layers` caches without the layer axis.
        """
        c = self.config
        capacity = c.context_length if capacity is None else capacity
        if not is_whole(capacity, 1):
            raise ValueError(f"init_cache needs a capacity >= 1 (positions to hold), got {capacity!r}")
        if batch is not None and not is_whole(batch, 1):
            raise ValueError(f"init_cache needs batch >= 1 (sequences) or None, got {batch!r}")
        self._check_length(capacity)
        rows = () if batch is None else (batch,)

        empty = lambda layers: KVCache.zeros((*layers, *rows), c.n_heads, c.d_head, capacity, c.compute_dtype)
        return self.blocks.per_layer(empty)

    @takes_token_ids(tokens="vocab_size")
    @typechecked
    def decode(
        self,
        tokens: Int[Array, "*batch new"],
        cache: KVCache | tuple[KVCache, ...],
        start: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "*batch new vocab"], KVCache | tuple[KVCache, ...]]:
        """Logits for `tokens` at positions `start, ..., start + new - 1`, reading and updating `cache`.

        Equal (up to float rounding) to the last `new` rows of `__call__` on the whole sequence so
        far, but costs only the new positions. Keep `start + new <= capacity`. `cache` comes from
        `init_cache` (a tuple of per-layer caches for an unstacked model). A batch of sequences
        `(batch, new)` sharing `start` takes a cache from `init_cache(batch=batch)`. Decoding is
        inference: it never drops out, in either mode.
        """
        capacity = self.blocks.first(cache).v.shape[-2]
        if not is_traced(start) and not 0 <= int(start) <= capacity - tokens.shape[-1]:
            raise ValueError(
                f"decode of {tokens.shape[-1]} token(s) at position {int(start)} does not fit a cache of "
                f"capacity {capacity}; keep start + new <= capacity (a larger init_cache, or a new window)"
            )
        self._check_ids(tokens)
        x = self._embed(tokens, start, capacity)
        # An array, not a Python int: the layers' scan then compiles once for every position.
        layer = eqx.Partial(_block_decode, start=jnp.asarray(start))
        x, cache = self.blocks.run(layer, x, cache)
        return self._logits(x), cache
