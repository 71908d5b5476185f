"""Pictures: a run's loss curves, attention heatmaps and the sinusoidal position table.

Figures are drawn with matplotlib's object API (`Figure`, no `pyplot`), which renders PNGs with
the Agg backend and needs no display. Every picture is written atomically (`atomic_write_bytes`),
so a reader never sees half an image.
"""

import io
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from eqx_gpt.errors import ConfigError
from eqx_gpt.files import atomic_write_bytes
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.positions import sinusoidal_positions

FORMATS = tuple(sorted(FigureCanvasAgg.get_supported_filetypes()))


def check_figure_path(path: str | Path, flag: str) -> Path:
    """`path` as a `Path` if a picture can be written there, else a one-line `ConfigError` (a
    `ValueError`) naming `flag` and the fix. Call it before any work whose result the picture shows."""
    path = Path(path)
    if path.suffix.lower().lstrip(".") not in FORMATS:
        raise ConfigError(
            f"{flag} {path}: unsupported picture format {path.suffix or '(none)'!r}; end the name in .png "
            f"(or one of {', '.join('.' + f for f in FORMATS)})"
        )
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {parent} does not exist; create it or pass another path")
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; pass a file name such as {path / 'picture.png'}")
    return path


def save_figure(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Render `fig` in the format its file name ends in and write it atomically."""
    path = Path(path)
    buffer = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buffer, format=path.suffix.lower().lstrip(".") or "png", dpi=dpi)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def plot_losses(records: list[dict], path: str | Path) -> Path:
    """Write `loss_figure(records)` to `path` (the run redraws `loss.png` at each evaluation)."""
    return save_figure(loss_figure(records), path)


def loss_figure(records: list[dict]) -> Figure:
    """Train (per logged step, and at evaluations) and validation loss against step, from the
    records of `metrics.jsonl`, and the final validation's point (`final_label` says which it is)."""
    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.add_subplot()
    steps = [r["step"] for r in records if "loss" in r]
    ax.plot(steps, [r["loss"] for r in records if "loss" in r], lw=0.8, alpha=0.45, label="train (batch)")
    evals = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", ms=3, label="train (eval)")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, label="validation")
    finals = [r for r in records if "final_val_loss" in r]
    if finals:  # a resumed run drops an earlier final record: the last is this run's
        final = finals[-1]
        ax.plot(
            [final["step"]], [final["final_val_loss"]], "*", ms=11, color="black", label=final_label(final)
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if evals:
        shown = [v for r in evals for v in (r["val_loss"], r["train_loss"])]
        shown += [r["final_val_loss"] for r in finals[-1:]]
        ax.set_ylim(max(0.0, min(shown) - 0.2), min(5.0, max(r["val_loss"] for r in evals) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def final_label(final: dict) -> str:
    """The legend entry of a final validation record: its loss, and whether it covers the whole
    split or estimates it from a sample of it (`whole_split`; a record without it says neither)."""
    n = f"{final['val_tokens']:,} tokens" if "val_tokens" in final else "tokens"
    whole = final.get("whole_split")
    covers = f", whole split ({n})" if whole is True else f", estimated from {n}" if whole is False else ""
    return f"final validation{covers}: {final['final_val_loss']:.4f}"


# Characters that would be invisible or break a tick label get a visible stand-in.
_VISIBLE = {"\n": "\\n", " ": "␣", "\t": "\\t", "\r": "\\r", "$": r"\$"}


def token_labels(pieces: list[str]) -> list[str]:
    """Tick labels for token strings: whitespace made visible, long pieces shortened."""
    labels = []
    for piece in pieces:
        text = "".join(_VISIBLE.get(ch, ch) for ch in piece)
        labels.append(text if len(text) <= 8 else text[:7] + "…")
    return labels


def plot_attention(
    weights: np.ndarray,
    labels: list[str],
    path: str | Path,
    *,
    title: str = "",
    key_labels: list[str] | None = None,
) -> Path:
    """Write a grid of heatmaps, one per (layer, head), of `weights` `(layers, heads, seq, kv_seq)`.

    Row `l`, column `h` shows `weights[l, h, query, key]`: queries down the side (`labels`), keys
    along the top (`key_labels`, default the same: self-attention). Returns the path written.
    """
    weights = np.asarray(weights)
    if weights.ndim != 4 or 0 in weights.shape:
        raise ValueError(
            f"plot_attention takes weights of shape (layers, heads, seq, kv_seq), got {weights.shape}"
        )
    n_layers, n_heads, seq, kv_seq = weights.shape
    key_labels = labels if key_labels is None else key_labels
    if len(labels) != seq or len(key_labels) != kv_seq:
        raise ValueError(
            f"plot_attention got {len(labels)} x {len(key_labels)} labels for {seq} x {kv_seq} weights"
        )
    cell = min(
        max(1.6, 0.14 * max(seq, kv_seq)), 3.5
    )  # inches per heatmap: readable labels, bounded image size
    fig = Figure(figsize=(cell * n_heads + 0.8, cell * n_layers + 0.6), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    show_ticks = max(seq, kv_seq) <= 48
    font = max(4, min(8, 220 // max(seq, kv_seq, 1)))
    images = []
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer, head]
            images.append(
                ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            )
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            if show_ticks:
                ax.set_xticks(range(kv_seq), key_labels, fontsize=font, rotation=90)
                ax.set_yticks(range(seq), labels, fontsize=font)
                ax.tick_params(length=0, labeltop=True, labelbottom=False)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
    fig.colorbar(images[-1], ax=axes, shrink=0.6, label="attention weight")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def plot_model_attention(model: GPT, tokens: list[int], pieces: list[str], path: str | Path) -> Path:
    """Draw `model`'s attention for `tokens` (their decoded `pieces` label the axes).

    Uses `GPT.attention_weights`, i.e. the very attention code the model runs. Only the last
    `context_length` tokens are drawn, as the model cannot see further back.
    """
    if not tokens:
        raise ValueError("plot_model_attention needs at least one token")
    context = model.config.context_length
    tokens, pieces = tokens[-context:], pieces[-context:]
    weights = eqx.filter_jit(GPT.attention_weights)(model, jnp.asarray(tokens, jnp.int32))
    return plot_attention(
        np.asarray(weights), token_labels(pieces), path, title="attention weights (query ↓, key →)"
    )


def plot_positions(context_length: int, d_model: int, path: str | Path) -> Path:
    """Write a heatmap of the sinusoidal position table `(context_length, d_model)` and a few of
    its sin columns as curves: low features oscillate fast, high features slowly."""
    table = np.asarray(sinusoidal_positions(context_length, d_model))
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    heat, curves = fig.subplots(1, 2, width_ratios=[1.3, 1])
    image = heat.imshow(table, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    heat.set_xlabel("feature (even: sin, odd: cos)")
    heat.set_ylabel("position")
    heat.set_title(f"sinusoidal positions ({context_length} x {d_model})")
    fig.colorbar(image, ax=heat)
    for feature in sorted({0, d_model // 16 * 2, d_model // 8 * 2, d_model // 4 * 2}):
        wavelength = 2 * np.pi * 10000 ** (feature / d_model)
        curves.plot(table[:, feature], label=f"feature {feature} (wavelength {wavelength:.0f})")
    curves.set_xlabel("position")
    curves.set_title("sin features: slower with each pair")
    curves.legend(fontsize=7, loc="lower left")
    return save_figure(fig, path)
