"""A run's set-up: everything resolved before the first step, checked, in one immutable record.

`set_up` reads the corpus (tokenized once into shards), the tokenizer, the model's config, the
devices and, on resume, the checkpoint; it builds the model and optimiser state; it writes nothing
in the run directory. What it resolves is a frozen `RunSetup`; what the loop will change starts as
a `TrainState`: the model, the optimiser state, the step, the schedule's length and the best
validation loss.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from eqx_gpt.checkpoint import (
    find_checkpoint,
    load_checkpoint,
    load_model,
    own_template,
    read_metadata,
    run_template,
)
from eqx_gpt.configs import fields_of_kind
from eqx_gpt.data.prepare import Corpus
from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.errors import ConfigError, TrainingError
from eqx_gpt.gpt2 import GPT2FormatError, gpt2_identity, gpt2_tokenizer, load_gpt2, read_gpt2_config
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.factory import build_model
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.language_model import ModelShape, check_language_model
from eqx_gpt.model.lora import apply_lora, lora_record
from eqx_gpt.peft import check_base, describe, load_adapters
from eqx_gpt.streams import EVAL_TRAIN_BATCHES, INIT, LORA_INIT, batch_key
from eqx_gpt.tokenizer import Tokenizer, tokenizer_from_dict
from eqx_gpt.training.config import TrainConfig, setting
from eqx_gpt.training.data import BUNDLED, check_split, fixed_batches, load_corpus
from eqx_gpt.training.options import ModelSettings, RunOptions
from eqx_gpt.training.parallel import check_batch, data_mesh, replicate, shard_parameters
from eqx_gpt.training.report import Progress
from eqx_gpt.training.run_dir import METRICS_NAME, final_recorded
from eqx_gpt.training.step import count_params, init_optimizer_state, make_optimizer, make_train_steps
from eqx_gpt.training.time_plan import eval_train_windows


@dataclass(frozen=True)
class RunSetup:
    """What a run resolved before its first step; nothing here changes while it trains."""

    config: TrainConfig
    model_config: GPTConfig | ModelShape  # a GPT's config, or the sizes of a model of one's own
    out_dir: Path
    tokenizer: Tokenizer
    train_ids: TokenSpan  # the splits' tokens, read from the shards as needed (`TokenSpan.rows`)
    val_ids: TokenSpan
    mesh: jax.sharding.Mesh
    train_steps: Callable  # the compiled steps (`make_train_steps`)
    eval_train_rows: np.ndarray  # fixed training windows: the train loss at evaluations
    checkpoint_meta: dict  # what every checkpoint of the run records besides the step and losses
    start: int  # the step the run (or this resumption of it) starts from
    resumed_from: Path | None  # the checkpoint resumed, if any

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.model_config.context_length


@dataclass
class TrainState:
    """What the loop changes as a run trains; everything else about it is fixed in `RunSetup`."""

    model: PyTree  # a GPT, or a model of one's own (a `LanguageModel`)
    opt_state: PyTree
    step: int  # optimiser steps done
    schedule_steps: int  # the schedule's length: the run ends here (`--max-minutes` may refit it)
    best_val: float = math.inf
    last_eval: tuple[int, float] | None = None  # (step, val loss) of the latest evaluation
    last_saved: int | None = None  # step of the latest `latest` checkpoint

    @property
    def evaluated(self) -> bool:
        """Whether the current step's evaluation is done."""
        return self.last_eval is not None and self.last_eval[0] == self.step


# The fields of a TrainConfig that the compiled step never reads (the schedule's rates arrive as
# arguments; the data, evaluation and logging are the loop's): each field's kind, `read_by_step`.
# Every other field is part of the step's identity, so an option added later can never be dropped
# from it by omission.
_NOT_READ_BY_THE_STEP = fields_of_kind(TrainConfig, "read_by_step", False)
_UNSCALED_BY_ADAMW = ("lr", "min_lr", "adam_lr")  # AdamW alone runs at unit rate times the schedule


def optimizer_and_step(config: TrainConfig, *, dropout: bool):
    """`make_optimizer` and `make_train_steps` for `config`, shared by runs whose steps are the same.

    The fields the step does not read are left out of the key, so a resumed run (or a second run
    in the same process, e.g. in tests) reuses the compiled step instead of compiling it again.
    """
    unread = _NOT_READ_BY_THE_STEP + (_UNSCALED_BY_ADAMW if config.optimizer == "adamw" else ())
    defaults = {f.name: f.default for f in fields(TrainConfig) if f.name in unread}
    return _optimizer_and_step(replace(config, **defaults), dropout)


@functools.lru_cache(maxsize=8)
def _optimizer_and_step(config: TrainConfig, dropout: bool):
    optimizer = make_optimizer(config)
    return optimizer, make_train_steps(optimizer, config, dropout=dropout)


def set_up(options: RunOptions, out_dir: Path, *, log: Callable[[str], None]) -> tuple[RunSetup, TrainState]:
    """Check the data, tokenizer, model and devices, and build the model and optimiser state
    (fresh, or from the checkpoint `options.checkpoint` describes). Reads `out_dir` but writes
    nothing there."""
    model_options, config, meta = options.model, options.train, options.checkpoint
    try:
        wanted = _tokenizer_wanted(config, meta, model_options)
        corpus, source, config = _load_corpus(config, meta, wanted, log)
        gpt_config, tokenizer = _model_config_and_tokenizer(
            model_options, config, corpus, meta, options.own_model
        )
    except (GPT2FormatError, TrainingError) as e:  # a value the preset set is named as the preset's
        raise type(e)(options.explain(str(e))) from None
    if gpt_config is None:
        own = _own_model(options, tokenizer.vocab_size, out_dir)
        model_config: GPTConfig | ModelShape = ModelShape.of(own)
    else:
        own, model_config = None, gpt_config
    for name, ids in (("train", corpus.train), ("validation", corpus.val)):
        check_split(ids, name, model_config.context_length, source)
    mesh = data_mesh()
    check_batch(mesh, config.batch_size, config.grad_accum)
    # Dropout keys for the model's dropout, or LoRA's on the adapters' input.
    # A model of one's own is always passed keys: its dropout is its own to know.
    dropout = not isinstance(model_config, GPTConfig) or model_config.dropout > 0
    dropout = dropout or (config.lora_rank is not None and config.lora_dropout > 0)
    optimizer, train_steps = optimizer_and_step(config, dropout=dropout)
    state = _initial_state(options, config, model_config, optimizer, out_dir, log, own)
    # Data parallelism: each batch split over the devices; parameters and optimiser state on every
    # device, or (--fsdp) split over them too.
    place = shard_parameters if config.fsdp else replicate
    state.model, state.opt_state = place((state.model, state.opt_state), mesh)
    # The first of the fixed batches' windows: all of them at a character vocabulary, fewer for a
    # costlier head.
    eval_train_rows = fixed_batches(
        corpus.train, seed=config.seed, stream=EVAL_TRAIN_BATCHES, n_batches=config.eval_batches,
        batch_size=config.batch_size, length=model_config.context_length + 1,
    ).reshape(-1, model_config.context_length + 1)[
        : eval_train_windows(config.eval_batches, config.batch_size, model_config)
    ]  # fmt: skip
    checkpoint_meta = {
        **({"preset": options.preset} if options.preset else {}),
        "data": source,
        "data_sha256": corpus.identity,
        "n_params": count_params(state.model),
        # A LoRA run's base, identified, so that resuming on a changed one is refused.
        **_lora_base(config, options.checkpoint),
    }
    log(data_line(source, corpus, tokenizer, given=config.data is not None))
    setup = RunSetup(
        config=config, model_config=model_config, out_dir=out_dir, tokenizer=tokenizer,
        train_ids=corpus.train, val_ids=corpus.val, mesh=mesh, train_steps=train_steps,
        eval_train_rows=eval_train_rows, checkpoint_meta=checkpoint_meta, start=state.step,
        resumed_from=Path(meta["path"]) if meta is not None else None,
    )  # fmt: skip
    return setup, state


def _lora_base(config: TrainConfig, meta: dict | None) -> dict:
    """`{"lora_base": identity}` of a LoRA run's base GPT-2 (the checkpoint's on resume, checked
    then against the folder), so that a changed base is refused; `{}` for other runs."""
    if config.lora_rank is None or config.init_from is None or config.model is not None:
        return {}
    return {"lora_base": meta.get("lora_base") if meta is not None else gpt2_identity(config.init_from)}


def data_line(source: str, corpus: Corpus, tokenizer: Tokenizer, *, given: bool) -> str:
    """The run's `data:` line: the corpus, what was read of data given (in square brackets, as its
    summary has round ones: `[read 2 files (2 .arrow)]`), the splits' tokens and the tokenizer."""
    read = f" [{corpus.summary}]" if given and corpus.summary else ""
    return (
        f"data: {source}{read}, {len(corpus.train):,} train / {len(corpus.val):,} validation tokens; "
        f"tokenizer {tokenizer.name} ({tokenizer.vocab_size} ids)"
    )


def _own_model(options: RunOptions, vocab_size: int, out_dir: Path) -> PyTree:
    """The model of the caller's own: the one passed to `train(model=...)` (trained as it is, or on
    resume the skeleton its checkpoint is read into), or the one `--model`'s function builds with the
    run's seed (on resume, as shapes). One line for a model of another vocabulary or class."""
    meta, spec = options.checkpoint, options.train.model
    if options.instance is not None:
        model = options.instance
        check_language_model(model, "train()'s model")
        if meta is not None and meta.get("model") != type(model).__name__:
            raise ConfigError(
                f"the run in {out_dir}/ trained a {meta.get('model')}, not a {type(model).__name__}; "
                f"pass the model it trained to resume it, or another --out-dir"
            )
        if model.vocab_size != vocab_size:
            raise ConfigError(
                f"the {type(model).__name__} has vocab_size {model.vocab_size}, but the tokenizer has "
                f"{vocab_size} ids; build it with vocab_size={vocab_size} (or pass model='MODULE:FUNCTION', "
                f"which is called with it)"
            )
        # A copy: the compiled steps update their inputs in place, and the caller keeps its model.
        return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)
    if spec is None:
        raise ConfigError(
            f"the run in {out_dir}/ trained a {(meta or {}).get('model')} passed to train(model=...), "
            f"which it cannot rebuild; pass that model again: train(model=..., resume=True)"
        )
    key = batch_key(options.train.seed, INIT, 0)
    if meta is not None:
        return eqx.filter_eval_shape(build_model, spec, vocab_size, key=key)
    return build_model(spec, vocab_size, key=key)


def _own_lora(model: PyTree, config: TrainConfig, log: Callable[[str], None]) -> PyTree:
    """`model` (a run's model of one's own) with the LoRA adapters `--lora-rank` asks for, if any."""
    if config.lora_rank is None:
        return model
    model = apply_lora(
        model, config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets,
        dropout=config.lora_dropout, key=batch_key(config.seed, LORA_INIT, 0),
    )  # fmt: skip
    record = lora_record(model) or {}
    log(f"LoRA rank {config.lora_rank} on {', '.join(record.get('targets', []))}; the base is frozen")
    return model


def _initial_state(options, config, model_config, optimizer, out_dir: Path, log, own) -> TrainState:
    """The model and optimiser state to start from: fresh (a model of one's own `own`, or GPT-2's
    weights with `--init-from`, or a new GPT), or the checkpoint's, refusing a run that already
    finished."""
    meta = options.checkpoint
    if meta is None:
        if own is not None and config.init_from is not None:  # a run of one's own model: its best
            log(f"init: {config.init_from}/ (a run of {config.model})")
            model = _own_lora(load_model(config.init_from, like=own)[0], config, log)
        elif own is not None:
            model = own
        elif config.init_from is not None:
            log(f"init: {config.init_from}/ (Hugging Face GPT-2)")
            model = load_gpt2(config.init_from, **options.model.gpt2_options())
            if config.lora_adapters is not None:
                log(f"init: LoRA adapters of {config.lora_adapters}/ (PEFT)")
                model = load_adapters(model, config.lora_adapters, dropout=config.lora_dropout)
            elif config.lora_rank is not None:
                key = batch_key(config.seed, LORA_INIT, 0)
                model = apply_lora(
                    model, config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets,
                    dropout=config.lora_dropout, key=key,
                )  # fmt: skip
            if config.lora_rank is not None:
                log(describe(model) + "; the base is frozen")
        else:
            model = GPT(model_config, key=batch_key(config.seed, INIT, 0))
        opt_state = init_optimizer_state(optimizer, model)
        return TrainState(model, opt_state, step=0, schedule_steps=options.schedule_steps)
    if options.schedule_steps < meta["step"]:  # a schedule that ends before the run's step
        raise TrainingError(
            f"max_steps={options.schedule_steps} ends before step {meta['step']}, where the run in "
            f"{out_dir}/ is; pass a {setting('max_steps')} of at least {meta['step']} to go on, or leave "
            f"it out"
        )
    if meta.get("lora_base") is not None:
        check_base(meta["lora_base"])
    template = own_template(meta, own) if own is not None else run_template(model_config, config.to_dict())
    opt_like = eqx.filter_eval_shape(init_optimizer_state, optimizer, template)
    model, opt_state, _, meta = load_checkpoint(meta, opt_like, like=template)
    start, schedule_steps = meta["step"], options.schedule_steps
    last_eval = saved_evaluation(meta)
    finished = start >= schedule_steps and (last_eval or (None,))[0] == start
    if finished and final_recorded(out_dir / METRICS_NAME, start):  # else: finish it now
        raise TrainingError(
            f"the run in {out_dir}/ already finished at step {start}; pass a larger {setting('max_steps')} "
            f"to go on"
        )
    best_val = meta.get("best_val_loss") or math.inf
    return TrainState(model, opt_state, start, schedule_steps, best_val, last_eval, last_saved=start)


def _tokenizer_wanted(config: TrainConfig, meta: dict | None, model_options: ModelSettings) -> dict:
    """What the corpus is tokenized with: the checkpoint's tokenizer on resume, GPT-2's (of
    --init-from's vocabulary) when fine-tuning, else --tokenizer ('char': the corpus's characters)."""
    if meta is not None:
        return {"kind": "char"} if meta["tokenizer"].get("kind") == "char" else meta["tokenizer"]
    if config.init_from is not None and config.model is not None:  # a run of one's own model: its tokenizer
        tokenizer = read_metadata(find_checkpoint(config.init_from))["tokenizer"]
        return {"kind": "char"} if tokenizer.get("kind") == "char" else tokenizer
    if config.init_from is not None:
        return gpt2_tokenizer(read_gpt2_config(config.init_from, **model_options.gpt2_options())).to_dict()
    return {"kind": config.tokenizer}


def _load_corpus(
    config: TrainConfig, meta: dict | None, tokenizer: dict, log: Callable[[str], None]
) -> tuple[Corpus, str, TrainConfig]:
    """`(corpus, source name, config)`: the corpus tokenized (once; later runs open its shards),
    checked against the checkpoint's on resume, and the config with the data path made absolute
    (so a run resumes from anywhere)."""
    corpus = load_corpus(
        config.data, tokenizer, text_field=config.text_field, split=config.split, resumes=meta, log=log,
        progress=Progress(),
    )  # fmt: skip
    if config.data is not None:
        config = replace(config, data=str(Path(config.data).resolve()))
    return corpus, config.data or BUNDLED, config


def _model_config_and_tokenizer(
    model_options: ModelSettings, config: TrainConfig, corpus: Corpus, meta: dict | None, own: bool
) -> tuple[GPTConfig | None, Tokenizer]:
    """The model's config and tokenizer: the checkpoint's on resume, GPT-2's from `--init-from`
    (of which `model_options` sets only `INIT_FROM_OPTIONS`), else built from the options and corpus.
    No config for a model of one's own (`own`): its shape is its own."""
    if meta is None and config.init_from is not None and not own:
        model_config = read_gpt2_config(config.init_from, **model_options.gpt2_options())
        return model_config, gpt2_tokenizer(model_config)
    tokenizer = corpus.tokenizer if meta is None else tokenizer_from_dict(meta["tokenizer"])
    if tokenizer != corpus.tokenizer and corpus.folder is not None:  # the same corpus: a damaged cache
        raise TrainingError(
            f"the corpus's tokens ({corpus.tokenizer!r}, in {corpus.folder}) are not the checkpoint's "
            f"({tokenizer!r}); delete that folder and resume again"
        )
    if tokenizer != corpus.tokenizer:  # a checkpoint that records no corpus identity (data_sha256)
        raise TrainingError(
            f"the corpus ({config.data or BUNDLED}) has other characters ({corpus.tokenizer!r}) than the "
            f"checkpoint's ({tokenizer!r}): it is not the text the run trained on; pass that with "
            f"{setting('data')}"
        )
    if own:
        return None, tokenizer
    try:
        return model_options.config(tokenizer.vocab_size), tokenizer
    except (TypeError, ValueError) as e:
        raise TrainingError(str(e)) from None


def saved_evaluation(meta: dict | None) -> tuple[int, float] | None:
    """`(step, val loss)` of the latest evaluation a checkpoint records."""
    if meta is None or meta.get("val_loss") is None:
        return None
    return meta.get("val_loss_step", meta["step"]), meta["val_loss"]
