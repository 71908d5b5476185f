"""`evaluate`: the loss over a whole text, against a brute-force computation."""

import dataclasses
import functools
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from gen_models import GROUP

from eqx_gpt import GPT, CharTokenizer, GPTConfig, TokenizerError
from eqx_gpt.evaluation import evaluate, evaluate_text, plan_whole

pytestmark = pytest.mark.xdist_group(GROUP)

CONTEXT = 8
ROWS = 64  # `_losses_at`'s rows, padded: one program for every text length


@functools.cache
def _model() -> GPT:
    """The tests' model, built once, by the process that runs them (not by every one that collects)."""
    return GPT(
        # The family's widths (tests/gen_models.py), so that building it compiles little new.
        GPTConfig(vocab_size=7, context_length=CONTEXT, d_model=32, n_heads=4, n_layers=2),
        key=jax.random.key(0),
    )


def windows(n_tokens: int, context: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """`(starts, counted)` of `plan_whole`: `counted[w, j]` says whether window `w` counts target `j`."""
    plan = plan_whole(n_tokens, context, stride)
    j = np.arange(context)
    return plan.starts, (j >= plan.first[:, None]) & (j < plan.end[:, None])


@eqx.filter_jit
def _losses_at(model, windows, lengths, targets):
    """The loss of `targets[i]` after the first `lengths[i]` tokens of `windows[i]` (padded: the
    model is causal, so what follows position `lengths[i] - 1` cannot change its logits)."""
    logits = jax.vmap(model)(windows)[jnp.arange(len(lengths)), lengths - 1]
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets)


def _mean_loss_by_hand(ids, contexts):
    return _mean_loss_by_hand_of(_model(), ids, contexts)


def _mean_loss_by_hand_of(model, ids, contexts):
    """Mean loss of predicting each `ids[t]` from `contexts[t - 1]` (a slice of ids before t), the
    model in inference mode."""
    n = len(contexts)
    assert n <= ROWS
    windows = np.zeros((ROWS, CONTEXT), np.int32)  # rows past n: a 1-token window, their loss unused
    lengths, targets = np.ones(ROWS, np.int32), np.zeros(ROWS, np.int32)
    for i, c in enumerate(contexts):
        windows[i, : len(c)] = c
        lengths[i] = len(c)
    targets[:n] = ids[1:]
    losses = np.asarray(_losses_at(eqx.nn.inference_mode(model), windows, lengths, targets))
    return float(np.mean(losses[:n]))  # NumPy's slice: JAX's, eager, compiles a program for every n


def _window_start(t, n, stride):
    """Where the window that predicts token t starts, by the rule in `evaluate`'s docstring."""
    last_start = max(0, n - 1 - CONTEXT)
    starts = [*range(0, last_start, stride), last_start]
    return next(s for s in starts if t <= s + CONTEXT)  # the first window that reaches t


@pytest.mark.parametrize("n", [2, 9, 37])
@pytest.mark.parametrize("stride", [3, CONTEXT // 2, CONTEXT])
def test_the_loss_is_every_tokens_loss_averaged_by_hand(n, stride):
    ids = np.random.default_rng(n).integers(0, 7, n)
    by_hand = _mean_loss_by_hand(ids, [ids[_window_start(t, n, stride) : t] for t in range(1, n)])
    result = evaluate(_model(), ids, stride=stride, batch=4)
    assert result.n_predicted == n - 1
    assert result.loss == pytest.approx(by_hand, rel=1e-5)


def test_with_stride_1_every_token_after_the_first_window_sees_a_full_context():
    ids = np.random.default_rng(0).integers(0, 7, 30)
    by_hand = _mean_loss_by_hand(ids, [ids[max(0, t - CONTEXT) : t] for t in range(1, 30)])
    assert evaluate(_model(), ids, stride=1, batch=4).loss == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("n", [2, 9, 10, 100])
def test_windows_count_each_target_once(n):
    for stride in (1, 2, 5, CONTEXT):
        starts, counted = windows(n, CONTEXT, stride)
        targets = [s + 1 + j for s, row in zip(starts, counted, strict=True) for j in np.flatnonzero(row)]
        assert sorted(targets) == list(range(1, n))


def test_bad_input_is_refused_with_the_fix():
    tokenizer = CharTokenizer("abcdefg")
    with pytest.raises(TokenizerError, match="'z'"):
        evaluate_text(_model(), tokenizer, "abcz")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        evaluate(_model(), [1])
    with pytest.raises(ValueError, match="stride must be an integer in"):
        evaluate(_model(), [1, 2, 3], stride=CONTEXT + 1)


def test_the_evaluate_face_scores_a_checkpoint_and_names_unknown_characters(tmp_path, capsys):
    import importlib.util

    from eqx_gpt import save_checkpoint

    spec = importlib.util.spec_from_file_location("evaluate_cli", Path(__file__).parents[1] / "evaluate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    tokenizer = CharTokenizer("abcdefg")
    save_checkpoint(tmp_path, "best", _model(), None, step=0, tokenizer=tokenizer, train_config={})
    (tmp_path / "text.txt").write_text("abcdefgabc" * 5)
    (tmp_path / "bad.txt").write_text("abcxyz")
    assert cli.main(["--checkpoint", str(tmp_path), "--text", str(tmp_path / "text.txt")]) == 0
    expected = evaluate(_model(), tokenizer.encode("abcdefgabc" * 5))
    assert f"loss {expected.loss:.4f} nats/token over 49 predicted tokens" in capsys.readouterr().out
    assert cli.main(["--checkpoint", str(tmp_path), "--text", str(tmp_path / "bad.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'x', 'y', 'z'" in err
    assert cli.main(["--checkpoint", str(tmp_path)]) == 2  # not the bundled corpus: --text is needed
    assert "pass --text PATH" in capsys.readouterr().err


@pytest.mark.parametrize(
    "tokens, error, named",
    [
        ([1, 2, 7], ValueError, r"token id 7 is outside the model's vocabulary \[0, 7\)"),
        ([1, -1, 2], ValueError, r"token id -1 is outside .*\[0, 7\)"),
        ([1, 2**32 + 1], ValueError, r"token id 4294967297 is outside"),
        ([1, 2**70], ValueError, r"token id 1180591620717411303424 is outside"),
        ([1.0, 2.5], TypeError, r"integer ids, got float64 values such as 1\.0"),
        ("abc", TypeError, r"a sequence of integer ids, got str"),
        ([True, False], TypeError, r"integer ids, got bool"),
    ],
)
def test_evaluate_refuses_ids_the_model_cannot_have_in_one_line(tokens, error, named):
    with pytest.raises(error, match=named) as caught:
        evaluate(_model(), tokens)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("batch", [0, -1, 1.5, True])
def test_evaluate_refuses_a_batch_that_is_not_a_positive_integer(batch):
    with pytest.raises(ValueError, match=rf"batch must be an integer in \[1, .*got {batch!r}"):
        evaluate(_model(), [1, 2, 3], batch=batch)


def test_evaluate_refuses_what_is_not_a_model_or_text():
    with pytest.raises(TypeError, match="the model must be a language model .* dict lacks"):
        evaluate({}, [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text must be a str, got list"):
        evaluate_text(_model(), CharTokenizer("abcdefg"), ["abc"])  # type: ignore[arg-type]


def test_evaluation_runs_the_model_without_dropout():
    config = dataclasses.replace(_model().config, dropout=0.5)  # the same shapes: no new programs to build it
    model = GPT(config, key=jax.random.key(1))
    ids = np.random.default_rng(1).integers(0, 7, 30)
    by_hand = _mean_loss_by_hand_of(model, ids, [ids[max(0, t - CONTEXT) : t] for t in range(1, 30)])
    assert evaluate(model, ids, stride=1, batch=4).loss == pytest.approx(by_hand, rel=1e-5)
