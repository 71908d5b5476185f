"""The decoder-only GPT: embeddings, a scanned stack of blocks, and the output projection."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from eqx_gpt._checks import typechecked
from eqx_gpt.attention import KVCache, causal_mask
from eqx_gpt.block import Block
from eqx_gpt.config import GPTConfig
from eqx_gpt.dropout import dropout, keys_per_sequence, split_key
from eqx_gpt.linear import linear
from eqx_gpt.norm import RMSNorm
from eqx_gpt.positions import sinusoidal_positions


class GPT(eqx.Module):
    """A decoder-only transformer language model acting on one sequence of token ids (or a batch).

    tokens -> `embed[tokens] * sqrt(d_model)` + sinusoidal positions -> `n_layers` pre-norm
    causal blocks -> RMSNorm -> `@ head` -> logits.

    The blocks are one `Block` whose arrays carry a leading `n_layers` axis (built with
    `eqx.filter_vmap`) and are run with `jax.lax.scan`, so the compiled program does not grow
    with depth. The embedding and head have `config.padded_vocab_size` rows/columns; the logits
    of the padding ids are **sliced off**, so `__call__` returns exactly `config.vocab_size`
    logits per position and a padding id can never be predicted or sampled.
    """

    embed: Float[Array, "padded_vocab d_model"]
    blocks: Block
    final_norm: RMSNorm
    head: Float[Array, "d_model padded_vocab"]
    config: GPTConfig = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        c = config
        self.config = c
        # Unit-variance token vectors after the sqrt(d_model) scale, comparable to the positions.
        self.embed = jax.random.normal(k_embed, (c.padded_vocab_size, c.d_model)) / math.sqrt(c.d_model)

        def make_block(k):
            return Block(c.d_model, c.n_heads, c.d_hidden, key=k, dropout=c.dropout, norm_eps=c.norm_eps)

        blocks = eqx.filter_vmap(make_block)(jax.random.split(k_blocks, c.n_layers))
        # GPT-2's scaled init: each residual branch adds variance, so shrink the projections that
        # write into the residual stream by 1/sqrt(2 * n_layers).
        scale = 1.0 / math.sqrt(2 * c.n_layers)
        self.blocks = eqx.tree_at(
            lambda b: (b.attn.w_out, b.mlp.w_out),
            blocks,
            (blocks.attn.w_out * scale, blocks.mlp.w_out * scale),
        )
        self.final_norm = RMSNorm(c.d_model, eps=c.norm_eps)
        self.head = 0.02 * jax.random.normal(k_head, (c.d_model, c.padded_vocab_size))

    def _embed(self, tokens, positions):
        c = self.config
        x = self.embed[tokens] * math.sqrt(c.d_model) + positions
        return x.astype(c.compute_dtype)

    def _logits(self, x):
        logits = linear(self.final_norm(x), self.head)
        return logits[..., : self.config.vocab_size].astype(jnp.float32)

    def _check_length(self, n: int) -> None:
        if n > self.config.context_length:
            raise ValueError(
                f"GPT got a sequence of {n} tokens but context_length={self.config.context_length}; "
                f"pass at most the last {self.config.context_length} tokens."
            )

    @typechecked
    def __call__(
        self, tokens: Int[Array, "*batch seq"], *, key: PRNGKeyArray | Key[Array, "*batch"] | None = None
    ) -> Float[Array, "*batch seq vocab"]:
        """Next-token logits `(seq, vocab_size)` for `tokens` of shape `(seq,)`.

        Position t sees tokens 0..t only (causal). With `key` and `config.dropout > 0`, dropout is
        applied (training); with `key=None` the call is deterministic.

        A batch `(batch, seq)` gives `(batch, seq, vocab_size)`, the same as `jax.vmap` over its
        rows, but faster: every projection is then one matrix multiply for the whole batch. Its
        `key` is one key per sequence, shape `(batch,)` (or one key, split into those).
        """
        seq = tokens.shape[-1]
        self._check_length(seq)
        if key is not None:
            key = keys_per_sequence(key, tokens.shape[:-1])
        k_embed, k_blocks = (None, None) if key is None else split_key(key, 2)
        x = dropout(
            self._embed(tokens, sinusoidal_positions(seq, self.config.d_model)), self.config.dropout, k_embed
        )
        mask = causal_mask(seq)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        layer_keys = None if k_blocks is None else split_key(k_blocks, self.config.n_layers)

        def layer(x, xs):
            block_arrays, k = xs
            return eqx.combine(block_arrays, static)(x, mask=mask, key=k), None

        x, _ = jax.lax.scan(layer, x, (dynamic, layer_keys), unroll=self.config.scan_unroll)
        return self._logits(x)

    @typechecked
    def attention_weights(self, tokens: Int[Array, " seq"]) -> Float[Array, "layers heads seq seq"]:
        """Every layer's and head's attention weights for `tokens` (deterministic, no dropout).

        Uses the very attention code of `__call__` (`MultiHeadAttention.weights`).
        """
        seq = tokens.shape[0]
        self._check_length(seq)
        x = self._embed(tokens, sinusoidal_positions(seq, self.config.d_model))
        mask = causal_mask(seq)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x, block_arrays):
            block = eqx.combine(block_arrays, static)
            return block(x, mask=mask), block.attn.weights(block.attn_norm(x), mask=mask)

        _, weights = jax.lax.scan(layer, x, dynamic)
        return weights

    def init_cache(self, capacity: int | None = None) -> KVCache:
        """An empty per-layer `KVCache` of shape `(n_layers, capacity, n_heads, d_head)`.

        `capacity` defaults to (and may not exceed) `config.context_length`.
        """
        c = self.config
        capacity = c.context_length if capacity is None else capacity
        self._check_length(capacity)
        shape = (c.n_layers, capacity, c.n_heads, c.d_head)
        return KVCache(k=jnp.zeros(shape, c.compute_dtype), v=jnp.zeros(shape, c.compute_dtype))

    @typechecked
    def decode(
        self, tokens: Int[Array, " new"], cache: KVCache, start: Int[Array, ""] | int
    ) -> tuple[Float[Array, "new vocab"], KVCache]:
        """Logits for `tokens` at positions `start, ..., start + new - 1`, reading and updating `cache`.

        Equal (up to float rounding) to the last `new` rows of `__call__` on the whole sequence so
        far, but costs only the new positions. Keep `start + new <= capacity`.
        """
        c = self.config
        capacity = cache.k.shape[1]
        positions = sinusoidal_positions(capacity, c.d_model)
        new_positions = jax.lax.dynamic_slice_in_dim(positions, start, tokens.shape[0])
        x = self._embed(tokens, new_positions)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x, xs):
            block_arrays, layer_cache = xs
            x, layer_cache = eqx.combine(block_arrays, static).decode(x, layer_cache, start)
            return x, layer_cache

        x, cache = jax.lax.scan(layer, x, (dynamic, cache), unroll=c.scan_unroll)
        return self._logits(x), cache
