"""The evaluation budget is priced by cost: a larger head reads fewer tokens, a character model all it did."""

from runs_family import GROUP, MODEL

from eqx_gpt import GPTConfig
from eqx_gpt.evaluation import periodic_plan
from eqx_gpt.tokenizer import GPT2_VOCAB_SIZE
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.presets import PRESETS
from eqx_gpt.training.time_plan import (
    REFERENCE_VOCAB,
    eval_budget,
    eval_price,
    eval_train_windows,
    forward_cost,
)

pytestmark = GROUP

CPU = PRESETS["cpu"].model
TINY_SHAKESPEARE_VAL = 111_540  # tokens of the bundled text's validation split


def test_a_character_vocabulary_keeps_the_whole_split():
    default = TrainConfig().eval_tokens
    config = GPTConfig(vocab_size=65, **CPU)
    assert eval_budget(default, config) == default and eval_price(config) == 1.0
    plan = periodic_plan(TINY_SHAKESPEARE_VAL, config.context_length, eval_budget(default, config))
    assert plan.whole


def test_gpt2s_vocabulary_reads_what_costs_the_same():
    default = TrainConfig().eval_tokens
    char, bpe = GPTConfig(vocab_size=65, **CPU), GPTConfig(vocab_size=GPT2_VOCAB_SIZE, **CPU)
    budget = eval_budget(default, bpe)
    assert budget == 15_905 and budget < default / 8
    # The same multiply-adds as the default budget at a reference head, to within one token's.
    reference = default * forward_cost(char, REFERENCE_VOCAB)
    assert 0 <= reference - budget * forward_cost(bpe) < forward_cost(bpe)


def test_the_budget_is_at_least_one_window():
    config = GPTConfig(vocab_size=GPT2_VOCAB_SIZE, **CPU)
    assert eval_budget(1, config) == config.context_length


def test_a_runs_evaluations_read_the_priced_budget():
    """The trainer's periodic and final validation plans use the priced budget, not --eval-tokens."""
    from types import SimpleNamespace

    import numpy as np

    from eqx_gpt.training.evaluate import val_plan

    bpe = GPTConfig(vocab_size=GPT2_VOCAB_SIZE, **CPU)
    config = TrainConfig()
    setup = SimpleNamespace(val_ids=np.zeros(1_000_000, np.uint16), model_config=bpe, config=config)
    budget = eval_budget(config.eval_tokens, bpe)
    periodic, final = val_plan(setup, final=False), val_plan(setup, final=True)  # type: ignore[arg-type]
    assert not periodic.whole and periodic.n_predicted <= budget < periodic.n_predicted + bpe.context_length
    assert not final.whole and final.n_predicted <= 4 * budget < final.n_predicted + bpe.context_length


def test_gpt2s_vocabulary_reads_fewer_train_loss_windows():
    char, bpe = GPTConfig(vocab_size=65, **CPU), GPTConfig(vocab_size=GPT2_VOCAB_SIZE, **CPU)
    assert eval_train_windows(16, 48, char) == 16 * 48  # a character head: every window, as before
    windows = eval_train_windows(16, 48, bpe)
    assert windows == 93
    # The same multiply-adds as 16 batches of 48 at a reference head, to within one window's.
    reference = 16 * 48 * forward_cost(char, REFERENCE_VOCAB)
    assert 0 <= reference - windows * forward_cost(bpe) < forward_cost(bpe)
    assert eval_train_windows(1, 1, bpe) == 1  # at least one window


def test_a_runs_train_loss_reads_the_first_of_its_fixed_windows(tmp_path):
    """`set_up` keeps the priced count of the fixed training windows, the first ones: a text of
    600 distinct characters has a head dearer than the reference's, so it reads fewer."""
    import random

    from eqx_gpt.streams import EVAL_TRAIN_BATCHES
    from eqx_gpt.training.data import fixed_batches
    from eqx_gpt.training.options import resolve_options
    from eqx_gpt.training.setup import set_up

    alphabet = [chr(0x4E00 + i) for i in range(600)]
    text = tmp_path / "wide.txt"
    text.write_text("".join(random.Random(0).choices(alphabet, k=60_000)), encoding="utf-8")
    options = resolve_options({"data": str(text), "batch_size": 4, "eval_batches": 3, **MODEL})
    setup, _ = set_up(options, tmp_path / "out", log=lambda line: None)
    c, model = setup.config, setup.model_config
    assert model.padded_vocab_size > REFERENCE_VOCAB
    windows = eval_train_windows(c.eval_batches, c.batch_size, model)
    assert 1 <= windows < 3 * 4 and len(setup.eval_train_rows) == windows
    every = fixed_batches(
        setup.train_ids, seed=c.seed, stream=EVAL_TRAIN_BATCHES, n_batches=3, batch_size=4,
        length=model.context_length + 1,
    ).reshape(-1, model.context_length + 1)  # fmt: skip
    assert (setup.eval_train_rows == every[:windows]).all()
