"""Choosing the next token from logits: temperature, top-k and nucleus (top-p) sampling.

Every function here acts on the logits of ONE position, shape `(vocab,)`, and works under `jit`
with traced `temperature`, `top_k` and `top_p` values (only whether a filter is used at all is a
Python-level choice), so changing a setting does not recompile.

One distribution for every path: `filtered_logits` (temperature, then top-k, then top-p) is what a
token is drawn from (`sample_next_token`, and through it `generate`, `translate` and the server)
and what the server's page shows (`next_token_distribution`).

Logits with no distribution (a NaN or `+inf` among them, or every one `-inf`: a diverged run, a NaN
adapter, a broken decoder) are never sampled from: where they are concrete the functions here
raise a one-line `ValueError`; under `jit`, where nothing can be raised, the drawn id is
`UNUSABLE` (-1), which `generate`, `translate` and the server check on the host and refuse.
"""

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from eqx_gpt._checks import INT32_MAX, is_real, is_traced, is_whole, typechecked


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise a one-line `ValueError` naming a bad sampling setting and its valid range."""
    if not (is_real(temperature) and temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and not is_whole(top_k, 1):
        raise ValueError(
            f"top_k must be an integer in [1, {INT32_MAX}] (or None to keep every token), got {top_k!r}"
        )
    if top_p is not None and not (is_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (or None to keep every token), got {top_p!r}")


def _concrete(value):
    """`value` as a Python number where it is known (not a tracer under `jit`), else None: the
    filters check their settings wherever they can."""
    if value is None or is_traced(value):
        return None
    if isinstance(value, jax.Array):
        return value.item() if value.size == 1 else None  # a wrong shape: the type check names it
    return value


@dataclass(frozen=True)
class SamplingOptions:
    """How `generate` and its relatives choose and stream tokens; checked on construction.

    temperature: 0 means greedy (`argmax`); otherwise logits are divided by it.
    top_k: sample among the `top_k` most likely tokens only (None: all).
    top_p: sample from the smallest set of tokens whose probability reaches `top_p` (None: all).
    keep: past `context_length`, the window is cut to its last `keep` tokens and re-run
        (None: `max(1, context_length // 2)`; `context_length` is nanoGPT's true sliding window).
    chunk_size: tokens per jitted decode call, i.e. per streamed chunk.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    keep: int | None = None
    chunk_size: int = 32

    def __post_init__(self):
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        if self.keep is not None and not is_whole(self.keep, 1):
            raise ValueError(f"keep must be an integer in [1, {INT32_MAX}] (or None), got {self.keep!r}")
        if not is_whole(self.chunk_size, 1):
            raise ValueError(f"chunk_size must be an integer in [1, {INT32_MAX}], got {self.chunk_size!r}")

    def window_keep(self, context_length: int) -> int:
        """The tokens kept when the window slides, for a model of `context_length`."""
        keep = max(1, context_length // 2) if self.keep is None else self.keep
        if keep > context_length:
            raise ValueError(f"keep must be an integer in [1, context_length={context_length}], got {keep}")
        return keep


DEFAULT_SAMPLING = SamplingOptions()  # temperature 1, no filters, the default window and chunks


def with_settings(options: SamplingOptions, settings: dict) -> SamplingOptions:
    """`options` with keyword `settings` (`temperature=0.8`, `top_k=40`, ...) laid over its fields,
    so `generate(..., temperature=0.8)` works as it did before `SamplingOptions` existed."""
    if not isinstance(options, SamplingOptions):
        raise TypeError(f"options must be a SamplingOptions, got {type(options).__name__}")
    names = [f.name for f in dataclasses.fields(SamplingOptions)]
    unknown = sorted(set(settings) - set(names))
    if unknown:
        raise TypeError(f"unknown sampling setting(s) {unknown}; the settings are {names}")
    return dataclasses.replace(options, **settings) if settings else options


def _ordered_keys(logits: Float[Array, " vocab"]) -> Int[Array, " vocab"]:
    """int32 keys in the order of the float32 `logits`, so a threshold can be searched for by
    bisection over integers: a float's bits, with the magnitude bits of negative ones flipped (and
    -0.0 read as 0.0, which it equals)."""
    x = logits.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _largest_where(holds, low: Int[Array, ""], high: Int[Array, ""]) -> Int[Array, ""]:
    """The largest integer `t` in `[low, high]` for which `holds(t)`, given that `holds` is true up
    to some point and false after it, and true at `low`: 32 halvings cover all of int32."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo | hi) - ((lo ^ hi) >> 1)  # the mean, rounded up, without overflowing int32
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (low, high))[0]


def _check_logits(logits, what: str) -> None:
    """Refuse, in one line naming `what`, logits that are not one position's: a float array of shape
    `(vocab,)` with at least one id."""
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 1 or shape[0] == 0:
        got = f"shape {tuple(shape)}" if shape is not None else type(logits).__name__
        raise ValueError(
            f"{what} takes the logits of one position, a float array of shape (vocab,) with vocab >= 1, "
            f"got {got}"
        )


UNUSABLE = -1  # the id drawn under `jit` from logits with no distribution (see the module docstring)


def usable(logits: Float[Array, "*rows vocab"]) -> Bool[Array, "*rows"]:
    """Whether each row of logits is a distribution: no NaN, no `+inf`, and some value above `-inf`.
    One reduction: the row's maximum is finite exactly then (a NaN propagates through `max`)."""
    return jnp.isfinite(jnp.max(logits, axis=-1))


def _refuse_unusable(logits, what: str) -> None:
    """Raise, in one line naming `what`, on concrete logits with no distribution (not under `jit`)."""
    if is_traced(logits):
        return
    values = np.asarray(logits)
    if np.isnan(values).any() or np.isposinf(values).any() or not (values > -np.inf).any():
        kind = "NaN" if np.isnan(values).any() else "+inf" if np.isposinf(values).any() else "only -inf"
        raise ValueError(
            f"{what} got logits holding {kind}: no distribution to sample from (a diverged model, a NaN "
            f"adapter or a broken decoder); check the model's weights and its logits"
        )


def _check_known(temperature=None, top_k=None, top_p=None) -> None:
    """`check_sampling_args` on the settings that are known (not traced under `jit`)."""
    t, k, p = _concrete(temperature), _concrete(top_k), _concrete(top_p)
    check_sampling_args(0.0 if t is None else t, k, p)


def _refuse_nan(logits, what: str) -> None:
    """A filter's check: concrete logits holding a NaN are refused in one line naming `what`."""
    if not is_traced(logits) and np.isnan(np.asarray(logits)).any():
        raise ValueError(f"{what} got logits holding NaN: nothing to filter; check the model's weights")


def _nan_stays(logits, filtered):
    """`filtered`, or all NaN where `logits` hold a NaN: a filter never hides one (under `jit`)."""
    return jnp.where(jnp.any(jnp.isnan(logits)), jnp.nan, filtered)


def top_k_filter(logits: Float[Array, " vocab"], k: Int[Array, ""] | int) -> Float[Array, " vocab"]:
    """`logits` with every token outside the `k` highest set to `-inf` (ties broken by lower id).
    `k` is an integer >= 1 (checked where it is known, i.e. not traced under `jit`)."""
    _check_logits(logits, "top_k_filter")
    _refuse_nan(logits, "top_k_filter")
    _check_known(top_k=k)
    return _top_k_filter_compiled(logits, k)


@typechecked
def _top_k_filter(logits: Float[Array, " vocab"], k: Int[Array, ""] | int) -> Float[Array, " vocab"]:
    # No sort: bisection finds the k-th largest value in 32 passes over the logits, where sorting
    # 50,257 of them per token cost more than the model's forward pass on a CPU.
    keys = _ordered_keys(logits)
    k = jnp.minimum(k, logits.shape[-1])  # a k past the vocabulary keeps every token
    kth = _largest_where(lambda t: jnp.sum(keys >= t) >= k, keys.min(), keys.max())
    above, tied = keys > kth, keys == kth
    # Of the tokens tied at the k-th value, the lowest ids fill the places left (argmax's order).
    keep = above | (tied & (jnp.cumsum(tied) <= k - jnp.sum(above)))
    return _nan_stays(logits, jnp.where(keep, logits, -jnp.inf))


def top_p_filter(logits: Float[Array, " vocab"], p: Float[Array, ""] | float) -> Float[Array, " vocab"]:
    """Nucleus filter: keep the smallest set of most probable tokens whose total probability
    reaches `p`, set the rest to `-inf`. The most probable token is always kept; `p == 1` keeps
    all. `p` is in `(0, 1]` (checked where it is known, i.e. not traced under `jit`).
    """
    _check_logits(logits, "top_p_filter")
    _refuse_nan(logits, "top_p_filter")
    _check_known(top_p=p)
    # A Python int (1) would reach the compiled filter as an integer array, which its check refuses.
    return _top_p_filter_compiled(logits, float(p) if isinstance(p, int) else p)


@typechecked
def _top_p_filter(
    logits: Float[Array, " vocab"], p: Float[Array, ""] | float | int
) -> Float[Array, " vocab"]:
    # A token stays when the tokens ranked above it have not yet reached p. Ranked by value, that
    # keeps every value from the smallest `last` with less than p above it; bisection finds it
    # without sorting the vocabulary.
    keys = _ordered_keys(logits)
    probs = jax.nn.softmax(logits)
    mass_above = lambda t: jnp.sum(jnp.where(keys > t, probs, 0.0))
    last = _largest_where(lambda t: mass_above(t) >= p, keys.min() - 1, keys.max()) + 1
    # Tokens tied at `last` are ranked by id: each stays while the mass above it is below p.
    tied = jnp.where(keys == last, probs, 0.0)
    keep = (keys > last) | ((keys == last) & (mass_above(last) + jnp.cumsum(tied) - tied < p)) | (p >= 1)
    return _nan_stays(logits, jnp.where(keep, logits, -jnp.inf))


# The public filters called outside `jit` run these: one program per shape, whatever `k` or `p`.
# Run op by op instead, each call would trace and compile its bisection loop anew (the loop's body
# is a new closure every call), about 0.1 s a call on a CPU.
_top_k_filter_compiled = jax.jit(_top_k_filter)
_top_p_filter_compiled = jax.jit(_top_p_filter)


def sample_next_token(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray,
    *,
    temperature: Float[Array, ""] | float = 1.0,
    top_k: Int[Array, ""] | int | None = None,
    top_p: Float[Array, ""] | float | None = None,
) -> Int[Array, ""]:
    """One token id drawn from `softmax(logits / temperature)` restricted by top-k then top-p
    (`filtered_logits`).

    `temperature == 0` means greedy (`argmax`, no randomness). `top_k=None` / `top_p=None` skip
    that filter. The filters are applied in the order temperature, top-k, top-p (top-p measures
    mass on the distribution that top-k left). Only ids `< len(logits)` can come out, so passing
    the model's (padding-free) logits never yields a padded vocabulary id. Settings are checked
    where they are known (not traced under `jit`): `temperature` finite and >= 0, `top_k` >= 1,
    `top_p` in `(0, 1]`. Logits with no distribution (NaN, `+inf`, or all `-inf`) raise a
    `ValueError` where concrete; under `jit` the id is `UNUSABLE` (-1).
    """
    _check_logits(logits, "sample_next_token")
    _refuse_unusable(logits, "sample_next_token")
    _check_known(temperature, top_k, top_p)
    return _sample_next_token(logits, key, temperature, top_k, top_p)


def filtered_logits(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""] | float | int,
    top_k: Int[Array, ""] | int | None,
    top_p: Float[Array, ""] | float | int | None,
) -> Float[Array, " vocab"]:
    """The logits a token is drawn from at `temperature > 0`: divided by the temperature, then
    top-k, then top-p (each skipped when None). The one definition of the sampling distribution."""
    # Any positive stand-in avoids 0/0 on the greedy path, which the callers discard.
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    if top_k is not None:
        scaled = _top_k_filter(scaled, top_k)
    if top_p is not None:
        scaled = _top_p_filter(scaled, top_p)
    return scaled


def next_token_distribution(
    logits: Float[Array, " vocab"],
    temperature: Float[Array, ""] | float,
    top_k: Int[Array, ""] | int | None = None,
    top_p: Float[Array, ""] | float | None = None,
) -> Float[Array, " vocab"]:
    """The probabilities `sample_next_token` draws from with these settings: the softmax of
    `filtered_logits`, or at `temperature == 0` all the mass on the argmax (what the page shows)."""
    greedy = jax.nn.one_hot(jnp.argmax(logits), logits.shape[-1])
    drawn = jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p))
    return jnp.where(temperature > 0, drawn, greedy)


@typechecked
def _sample_next_token(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray,
    temperature: Float[Array, ""] | float | int,
    top_k: Int[Array, ""] | int | None,
    top_p: Float[Array, ""] | float | int | None,
) -> Int[Array, ""]:
    greedy = jnp.argmax(logits)
    drawn = _draw(key, filtered_logits(logits, temperature, top_k, top_p))
    token = jnp.where(temperature > 0, drawn, greedy)
    return jnp.where(usable(logits), token, UNUSABLE).astype(jnp.int32)


DRAW_BLOCK = 256  # ids per block of the two-stage draw


def _draw(key: PRNGKeyArray, logits: Float[Array, " vocab"]) -> Int[Array, ""]:
    """One id drawn from `softmax(logits)`, in two stages: a block of `DRAW_BLOCK` ids by its
    total probability, then an id within that block. The product is exactly the softmax, and a
    draw takes about 450 random numbers instead of one per id: for GPT-2's 50,257 ids that
    random stream cost more than the filters and the argmax together."""
    vocab = logits.shape[0]
    if vocab <= DRAW_BLOCK:
        return jax.random.categorical(key, logits)
    blocks = -(-vocab // DRAW_BLOCK)
    padded = jnp.pad(logits, (0, blocks * DRAW_BLOCK - vocab), constant_values=-jnp.inf)
    padded = padded.reshape(blocks, DRAW_BLOCK)
    key_block, key_id = jax.random.split(key)
    block = jax.random.categorical(key_block, jax.nn.logsumexp(padded, axis=1))
    return block * DRAW_BLOCK + jax.random.categorical(key_id, padded[block])


def row_key(key: PRNGKeyArray, row, index) -> PRNGKeyArray:
    """The key of token `index` of sample (row) `row`: `fold_in(fold_in(key, row), index)`, so a
    key gives the same tokens however the loop is chunked, and row 0 of a batch equals `generate`."""
    return jax.random.fold_in(jax.random.fold_in(key, row), index)


def sample_rows(logits, key, index, temperature, top_k, top_p):
    """Token `index` of every row of `logits` `(rows, vocab)`: row `r` draws with `row_key(key, r,
    index)`; `UNUSABLE` for a row with no distribution.

    At `temperature == 0` only the argmax runs: the filters and the draw are skipped by a `cond`
    outside the `vmap`, where it stays a branch. Each row's `usable` is taken once, after it: in a
    small model's decode step every extra reduction shows (checked in both branches, per row, it
    made `generate`'s compiled decode loop 144 fusions on a CPU instead of 135)."""
    keys = jax.vmap(lambda r: row_key(key, r, index))(jnp.arange(logits.shape[0]))
    draw = lambda lg, k: _draw(k, filtered_logits(lg, temperature, top_k, top_p)).astype(jnp.int32)
    token = jax.lax.cond(
        jnp.asarray(temperature) > 0,
        lambda: jax.vmap(draw)(logits, keys),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
    )
    return jnp.where(usable(logits), token, UNUSABLE)


def sampling_arrays(options: SamplingOptions) -> dict:
    """Sampling settings as traced arrays (no recompiles); greedy skips the filters entirely."""
    o, greedy = options, options.temperature == 0
    return dict(
        temperature=jnp.asarray(o.temperature, jnp.float32),
        top_k=None if greedy or o.top_k is None else jnp.asarray(o.top_k, jnp.int32),
        top_p=None if greedy or o.top_p is None else jnp.asarray(o.top_p, jnp.float32),
    )
