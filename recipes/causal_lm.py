"""Instruction tuning of a keras-hub causal language model on prompt/response or chat JSONL.

A recipe of its own, not a `task` of `transformer_finetune`: everything but the
harness differs (a `CausalLM` preset instead of a `TextClassifier`, targets that are
the next tokens weighted per token instead of a label per text, perplexity and sample
generations instead of accuracy), and a shared module would branch on the task at
every step.

Reads top to bottom: the `Config`, `build_preprocessor`, `build_data`, `build_model`,
`build_optimizer`, `compile_model`, `build_callbacks`, `train`, `write_samples`. Any
keras-hub `CausalLM` preset works: a preset name (`gpt2_base_en`, `gemma3_instruct_270m`,
`gemma3_1b`, `llama3_8b_en`, `qwen3_4b_en`, `smollm3_3b_en`, ...; downloaded by
keras-hub where the network allows) or a local preset directory (what
`task.save_to_preset(dir)` writes).

The data (`trainwell.data.instructions`): JSONL lines `{"prompt", "response"}` or
`{"messages": [{"role", "content"}, ...]}` with the roles `system`, `user` and
`assistant`, written with `chat_template` (`"plain"`: `User: ...` lines; `"gemma"`: Gemma's
`<start_of_turn>` turns, for Gemma instruct presets); in a chat *every* assistant turn is a
response. The loss counts only
response tokens (and the end token after the last): a token's sample weight is 0 on
the start token, prompt tokens and padding, so the targets at prompt positions
contribute exactly 0 to the loss and its gradient. The loss of a batch is the mean over
its response tokens (`reduction="mean_with_sample_weight"`).

No packing: keras-hub's causal LM backbones (GPT-2, Gemma, Llama, Qwen, ...) take a
`token_ids` and a `padding_mask` only, and build one causal mask over the whole row;
there is no segment id or per-example position reset, so examples packed into one row
would attend to each other. `packing=true` is refused in one line. Rows are padded to
`sequence_length`.

Evaluation: `eval_loss` (the mean token loss over the held-out response tokens, each
token counted once: not a mean of batch means) and `eval_perplexity` (its exp) go to
`metrics.json`; each epoch logs `val_token_loss` and `val_perplexity`; and
`samples.jsonl` in the run directory holds `num_samples` greedy generations of held-out
prompts beside their references.

LoRA (`trainwell.models.lora`): `lora="auto"` (the default) fine-tunes every weight of
a backbone of at most `LORA_AUTO_PARAMS` (500 million) parameters (GPT-2 base and
medium, Gemma 3 270M) and trains rank-`lora_rank` adapters on the attention's query
and value projections of a larger one (Gemma 3 1B, Llama 3 8B, ...), the rest frozen;
`"on"` and `"off"` force it. The export merges the adapters.

Example:
>>> from trainwell.recipes import causal_lm
>>> run = causal_lm.train(preset="gpt2_base_en", dataset="jsonl:train.jsonl",
...                       sequence_length=256, epochs=1)  # doctest: +SKIP
>>> run.metrics["eval_perplexity"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import types
from pathlib import Path
from typing import Literal, Optional

import numpy as np

from trainwell.config import (
    BaseConfig,
    check_choice,
    check_dir_path,
    check_positive,
    check_range,
    check_reliability_fields,
    config_error,
    raise_invalid,
)
from trainwell import runtime
from trainwell.data import instructions
from trainwell.data.base import resolve_path
from trainwell.data.sources import check_preset, preset_max_sequence_length
from trainwell.io import atomic_write_text
from trainwell.compat.sharded import spans_processes
from trainwell.models.lora import enable_lora, merged_copy

RECIPE = "causal-lm"
EXPORT_DIR = "model"
SAMPLES_FILE = "samples.jsonl"
#: Backbones above this many parameters train LoRA adapters by default (`lora="auto"`).
LORA_AUTO_PARAMS = 500_000_000
NO_DECAY_NAMES = ("gamma", "beta", "bias", "scale")  # norms and biases


@dataclasses.dataclass
class Config(BaseConfig):
    """Hyperparameters of causal-LM instruction tuning.

    Sources: [Alpaca] Taori et al. 2023 (cosine schedule, warmup ratio 0.03, 3 epochs,
    LR 2e-5 for full fine-tuning); [LoRA] Hu et al. 2021 (query and value, rank 8);
    [torchtune] LoRA recipes (LR 3e-4, weight decay 0.01, clipping at 1.0).

    Example:
    >>> c = Config(dataset="jsonl:train.jsonl", validate_data=False)
    >>> (c.epochs, c.warmup_fraction, c.lora, c.lora_rank, c.packing)
    (3, 0.03, 'auto', 8, False)
    """

    dataset: str = "jsonl:train.jsonl"  # "jsonl:PATH" (or a .jsonl path) of {"prompt","response"} or {"messages"}
    eval_dataset: Optional[str] = None  # held-out JSONL; None: val_fraction of dataset
    epochs: int = 3  # [Alpaca]
    max_steps: Optional[int] = None  # a cap on the run's steps
    batch_size: int = 8  # global batch, in examples
    precision: str = "auto"
    strategy: str = "auto"
    seed: int = 0
    run_dir: Optional[str] = None
    # -- model
    preset: str = "gpt2_base_en"  # keras-hub CausalLM preset name or local preset directory
    sequence_length: int = 256  # tokens the model reads per example (prompt + response + end)
    truncate: bool = False  # cut too-long examples (prompt from the left); False: refuse them
    chat_template: Literal["plain", "gemma"] = "plain"  # how "messages" are written (trainwell.data.instructions)
    packing: bool = False  # refused: keras-hub's masks cannot keep packed examples apart
    lora: Literal["auto", "on", "off"] = "auto"  # auto: LoRA above LORA_AUTO_PARAMS backbone parameters
    lora_rank: int = 8  # [LoRA]
    lora_alpha: Optional[float] = None  # adapters scaled by lora_alpha / lora_rank; None: lora_rank
    lora_target_layers: Optional[list[str]] = None  # None: the backbone's default_lora_layer_names()
    # -- data
    data_dir: Optional[str] = None  # base of relative paths
    val_fraction: float = 0.1  # carved from dataset when eval_dataset is None
    split_seed: int = 0  # seed of the carved held-out set, apart from `seed`: it stays fixed
    max_train_examples: Optional[int] = None  # None: all (a cap for quick runs)
    validate_data: bool = True  # parse the JSONL when the config is made (one-line errors before a run)
    # -- optimisation
    peak_lr: Optional[float] = None  # None: 3e-4 with LoRA [torchtune], 2e-5 without [Alpaca]
    weight_decay: float = 0.01  # [torchtune]; decoupled, not on norms and biases
    global_clipnorm: Optional[float] = 1.0  # [torchtune]
    warmup_fraction: float = 0.03  # [Alpaca]
    min_lr: float = 0.0  # the cosine decays to it [Alpaca]: 0
    # -- evaluation
    num_samples: int = 3  # held-out prompts generated into samples.jsonl (0: none)
    # -- performance
    jit_compile: Optional[bool] = None
    steps_per_execution: Optional[int] = None
    # -- reliability
    checkpoint_every: str = "epoch"
    keep_last: int = 3
    nan_rollback: bool = True
    snapshot_every: int = 100
    early_stopping_patience: Optional[int] = None
    doctor: bool = True
    deterministic: bool = False
    export: bool = True  # save the (merged) model and its tokenizer to RUN_DIR/model
    verbose: Literal["auto", 0, 1, 2] = "auto"  # Keras fit verbosity ("0" on the command line is 0)

    def validate(self) -> None:
        super().validate()
        if self.packing:
            raise_invalid("packing", self.packing, "false: keras-hub's causal LM backbones take only a padding_mask "
                          "(no segment ids), so examples packed into one sequence would attend to each other")
        check_preset(self.preset, "preset", task="CausalLM")
        if self.sequence_length < 4:
            raise_invalid("sequence_length", self.sequence_length, "an integer >= 4")
        longest = preset_max_sequence_length(self.preset)
        if longest is not None and self.sequence_length > longest:  # it crashed inside the step's position embedding
            raise_invalid("sequence_length", self.sequence_length,
                          f"an integer <= {longest}: the preset's backbone takes at most {longest} positions")
        check_choice(self, "lora", ("auto", "on", "off"))
        check_choice(self, "chat_template", tuple(instructions.CHAT_TEMPLATES))
        check_positive(self, "lora_rank")
        check_positive(self, "lora_alpha")
        if self.lora_target_layers is not None and not all(str(n).strip() for n in self.lora_target_layers or [""]):
            raise_invalid("lora_target_layers", self.lora_target_layers, "null or a non-empty list of layer names")
        check_range(self, "val_fraction", 0.0, 1.0, hi_open=True)
        if self.eval_dataset is None and self.val_fraction == 0:
            raise_invalid("val_fraction", self.val_fraction, "> 0 when eval_dataset is null (a held-out set)")
        check_positive(self, "max_train_examples")
        check_positive(self, "max_steps")
        check_positive(self, "peak_lr")
        check_positive(self, "weight_decay", allow_zero=True)
        check_positive(self, "global_clipnorm")
        check_range(self, "warmup_fraction", 0.0, 1.0, hi_open=True)
        check_positive(self, "min_lr", allow_zero=True)
        check_positive(self, "num_samples", allow_zero=True)
        check_reliability_fields(self)
        check_dir_path(self.data_dir, "data_dir")
        for field in ("dataset", "eval_dataset"):
            if getattr(self, field) is not None:
                jsonl_path(getattr(self, field), self.data_dir, field)
        if self.validate_data:
            read_examples(self.dataset, self.data_dir, "dataset", self.chat_template)
            if self.eval_dataset is not None:
                read_examples(self.eval_dataset, self.data_dir, "eval_dataset", self.chat_template)


def jsonl_path(source: str, data_dir: Optional[str] = None, field: str = "dataset") -> str:
    """The file of a `"jsonl:PATH"` source (or a path ending in `.jsonl`), under `data_dir` when relative.

    Raises:
        trainwell.config.ConfigError: `source` is neither.

    Example:
    >>> jsonl_path("jsonl:train.jsonl", "/data")
    '/data/train.jsonl'
    """
    kind, sep, rest = source.partition(":")
    if sep and kind.strip().lower() == "jsonl":
        return resolve_path(rest.strip(), data_dir)
    if source.strip().lower().endswith(".jsonl"):
        return resolve_path(source.strip(), data_dir)
    raise config_error(field, source, "expected 'jsonl:PATH' (one {\"prompt\", \"response\"} or "
                       "{\"messages\"} object per line)")


_PARSED: dict = {}  # (path, size, mtime) -> examples: the config's check and the run read a file once


def read_examples(source: str, data_dir: Optional[str] = None, field: str = "dataset",
                  chat_template: str = "plain") -> list:
    """The examples of `"jsonl:PATH"` (or a path ending in `.jsonl`), parsed once per file version and template.

    Raises:
        trainwell.config.ConfigError: `source` is not a JSONL source.
        trainwell.data.base.DataError: The file is missing or holds a bad line (one line).

    Example:
    >>> read_examples("jsonl:train.jsonl")  # doctest: +SKIP
    """
    path = jsonl_path(source, data_dir, field)
    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, chat_template)
    except OSError:
        key = None
    if key is None or key not in _PARSED:
        examples = instructions.read_jsonl(path, chat_template)  # a file that cannot be stat'ed: its one-line error
        _PARSED.clear()
        _PARSED[key] = examples
    return _PARSED[key]


def _cfg(cfg: Config | None, overrides: dict) -> Config:
    if cfg is None:
        return Config(**overrides)
    return cfg.replace(**overrides) if overrides else cfg


def _preset(preset: str) -> str:
    p = Path(preset).expanduser()
    return str(p.resolve()) if p.is_dir() else preset


# --------------------------------------------------------------------------- data
def build_preprocessor(cfg: Config):
    """The preset's `CausalLMPreprocessor` (its tokenizer) at `cfg.sequence_length`.

    Example:
    >>> pre = build_preprocessor(Config(preset="gpt2_base_en", validate_data=False))  # doctest: +SKIP
    """
    import keras_hub  # lazy: keras-hub loads on first use, not with this module

    return keras_hub.models.CausalLMPreprocessor.from_preset(_preset(cfg.preset), sequence_length=cfg.sequence_length)


def tokenize(cfg: Config, preprocessor, examples, path: str = "the data"):
    """`(ids, weights, lengths)` of `examples` at `sequence_length + 1` tokens (`instructions.tokenize`).

    The start and end tokens are the preprocessor's (`add_start_token`, `add_end_token`).

    Example:
    >>> ids, w, n = tokenize(cfg, build_preprocessor(cfg), read_examples(cfg.dataset))  # doctest: +SKIP
    """
    tok = preprocessor.tokenizer

    def tokenize_fn(texts):
        out = tok(texts)
        out = out.to_list() if hasattr(out, "to_list") else out
        return [[int(t) for t in row] for row in out]

    return instructions.tokenize(
        examples, tokenize_fn, cfg.sequence_length + 1,
        start_id=tok.start_token_id if preprocessor.add_start_token else None,
        end_id=tok.end_token_id if preprocessor.add_end_token else None,
        pad_id=tok.pad_token_id, truncate=cfg.truncate, path=path,
    )


def split_examples(cfg: Config) -> tuple[list, list]:
    """`(train, held_out)` examples: `eval_dataset`, or `val_fraction` of `dataset` carved with `split_seed`.

    Example:
    >>> train_ex, eval_ex = split_examples(cfg)  # doctest: +SKIP
    """
    examples = read_examples(cfg.dataset, cfg.data_dir, "dataset", cfg.chat_template)
    if cfg.eval_dataset is not None:
        train, held = list(examples), read_examples(cfg.eval_dataset, cfg.data_dir, "eval_dataset", cfg.chat_template)
    else:
        order = np.random.default_rng(cfg.split_seed).permutation(len(examples))
        n_val = max(1, int(round(cfg.val_fraction * len(examples))))
        if n_val >= len(examples):
            raise config_error("val_fraction", cfg.val_fraction,
                               f"leaves no training example of the {len(examples)} in {cfg.dataset!r}")
        held = [examples[i] for i in sorted(order[:n_val])]
        train = [examples[i] for i in sorted(order[n_val:])]
    if cfg.max_train_examples is not None:
        train = train[: cfg.max_train_examples]
    return train, held


def _dataset(ids, weights, lengths, batch_size: int, seed: Optional[int]):
    import tensorflow as tf  # lazy: TensorFlow loads when a run starts

    mask = np.arange(ids.shape[1] - 1)[None, :] < (lengths[:, None] - 1)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask}
    ds = tf.data.Dataset.from_tensor_slices((x, ids[:, 1:], weights[:, 1:]))
    if seed is not None:  # reshuffled each epoch, the k-th iterator the k-th epoch (harness.advance_epochs)
        ds = ds.shuffle(len(ids), seed=seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def build_data(cfg: Config, preprocessor):
    """Tokenized train and held-out pipelines of `(x, next_tokens, weights)` batches.

    Returns:
        A namespace: `train` and `val` (`tf.data`), `steps_per_epoch`, `held_out` (the
        held-out examples, for samples) and `val_tokens` (response tokens held out).

    Example:
    >>> data = build_data(cfg, build_preprocessor(cfg))  # doctest: +SKIP
    """
    train_ex, held = split_examples(cfg)
    tr = tokenize(cfg, preprocessor, train_ex, cfg.dataset)
    va = tokenize(cfg, preprocessor, held, cfg.eval_dataset or cfg.dataset)
    return types.SimpleNamespace(
        train=_dataset(*tr, cfg.batch_size, cfg.seed), val=_dataset(*va, cfg.batch_size, None),
        steps_per_epoch=-(-len(train_ex) // cfg.batch_size), held_out=held, val_tokens=int(va[1][:, 1:].sum()),
    )


# --------------------------------------------------------------------------- model
def uses_lora(cfg: Config, backbone) -> bool:
    """Whether the run trains LoRA adapters: `lora="on"`, or `"auto"` above `LORA_AUTO_PARAMS` parameters.

    Example:
    >>> uses_lora(Config(lora="off", validate_data=False), backbone=None)
    False
    """
    if cfg.lora != "auto":
        return cfg.lora == "on"
    return backbone.count_params() > LORA_AUTO_PARAMS


def build_model(cfg: Config):
    """The preset's `CausalLM`, without its preprocessor, with LoRA where `uses_lora` says.

    Example:
    >>> model = build_model(cfg)  # doctest: +SKIP
    """
    import keras  # lazy: Keras loads on first use, not with this module
    import keras_hub

    model = keras_hub.models.CausalLM.from_preset(
        _preset(cfg.preset), preprocessor=None, dtype=keras.config.dtype_policy().name)
    if uses_lora(cfg, model.backbone):
        enable_lora(model.backbone, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_layers)
    return model


def backbone_class(cfg: Config):
    """The preset's keras-hub `Backbone` class, read from its config without building it.

    Example:
    >>> backbone_class(cfg).__name__  # doctest: +SKIP
    'GemmaBackbone'
    """
    from trainwell.compat.keras_internals import preset_backbone_class  # lazy: it imports Keras

    return preset_backbone_class(_preset(cfg.preset))


def _lora_on(model) -> bool:
    return any("lora_" in v.path for v in model.weights)


def phase_steps(cfg: Config, steps_per_epoch: int) -> tuple[int, int]:
    """`(total, warmup)` steps of the run.

    Example:
    >>> phase_steps(Config(epochs=3, validate_data=False), 100)
    (300, 9)
    """
    total = max(1, cfg.epochs * int(steps_per_epoch))
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return total, int(round(cfg.warmup_fraction * total))


def default_peak_lr(lora: bool) -> float:
    """The peak LR of `peak_lr=None`: 3e-4 with LoRA [torchtune], 2e-5 without [Alpaca].

    Example:
    >>> default_peak_lr(True), default_peak_lr(False)
    (0.0003, 2e-05)
    """
    return 3e-4 if lora else 2e-5


def build_optimizer(cfg: Config, steps_per_epoch: int, lora: bool):
    """AdamW on warmup-then-cosine decay, no weight decay on norms and biases, global clipping.

    Example:
    >>> opt = build_optimizer(Config(validate_data=False), 100, lora=True)  # doctest: +SKIP
    """
    import keras  # lazy: Keras loads on first use, not with this module

    from trainwell.callbacks.schedules import WarmupCosineDecay  # lazy: the callbacks import Keras

    total, warmup = phase_steps(cfg, steps_per_epoch)
    peak = cfg.peak_lr if cfg.peak_lr is not None else default_peak_lr(lora)
    lr = WarmupCosineDecay(peak, total_steps=total, warmup_steps=warmup, min_lr=min(cfg.min_lr, peak))
    opt = keras.optimizers.AdamW(learning_rate=lr, weight_decay=cfg.weight_decay, global_clipnorm=cfg.global_clipnorm)
    opt.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return opt


def compile_model(cfg: Config, model, steps_per_epoch: int) -> None:
    """Compiles with the response-token mean loss, `token_loss` and `perplexity`, greedy sampling.

    Example:
    >>> compile_model(cfg, model, steps_per_epoch=100)  # doctest: +SKIP
    """
    import keras  # lazy: Keras loads on first use, not with this module
    import keras_hub

    from trainwell.recipes.harness import steps_per_execution  # lazy: the harness's helpers import Keras

    model.compile(
        optimizer=build_optimizer(cfg, steps_per_epoch, _lora_on(model)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight"),
        weighted_metrics=[  # means over weighted (response) tokens of all batches: each token once
            keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="token_loss"),
            keras_hub.metrics.Perplexity(from_logits=True, name="perplexity"),
        ],
        sampler="greedy",
        jit_compile="auto" if cfg.jit_compile is None else cfg.jit_compile,
        steps_per_execution=steps_per_execution(cfg.steps_per_execution),
    )


def lr_find_setup(cfg: Config):
    """A compiled model and the training data, for `trainwell lr-find`.

    Example:
    >>> model, data = lr_find_setup(cfg)  # doctest: +SKIP
    """
    pre = build_preprocessor(cfg)
    data_ = build_data(cfg, pre)
    model = build_model(cfg)
    compile_model(cfg, model, data_.steps_per_epoch)
    return model, data_.train


# --------------------------------------------------------------------------- callbacks
def build_callbacks(cfg: Config, run_dir, schedule=None, chief: bool = True, lora: bool = False) -> list:
    """trainwell's reliability stack, following the held-out `val_token_loss` (lower is better).

    With `lora` (the model trains adapters), checkpoints leave the frozen base out
    (`Checkpoint(frozen_weights="non_trainable")`): a resume rebuilds it from the preset.

    Example:
    >>> cbs = build_callbacks(Config(validate_data=False), "/tmp/run")  # doctest: +SKIP
    """
    from trainwell.recipes.harness import standard_callbacks  # lazy: it imports Keras

    return standard_callbacks(
        cfg, run_dir, monitor="val_token_loss", mode="min", schedule=schedule,
        checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last, nan_rollback=cfg.nan_rollback,
        snapshot_every=cfg.snapshot_every, early_stopping_patience=cfg.early_stopping_patience,
        doctor=cfg.doctor, chief=chief, frozen_weights="non_trainable" if lora else None,
    )


# --------------------------------------------------------------------------- train
def train(cfg: Config | None = None, *, callbacks=None, **overrides):
    # one piece: a run's steps in their order inside one `setup_run` scope: data, model, fit, evaluation, samples, export
    """Fine-tunes the preset on the instruction data and returns a `harness.RunResult`.

    Args:
        cfg: A `Config`. Defaults to `None` (the defaults).
        callbacks: Extra Keras callbacks, after the recipe's own. Defaults to `None`.
        **overrides: Config fields to change.

    Returns:
        `RunResult`; `metrics` holds `eval_loss`, `eval_perplexity` and `eval_tokens`;
        `model` has its preprocessor attached (`model.generate("...")` works). The run
        directory holds `samples.jsonl` and, with `export`, the model (LoRA merged) in `model/`.

    Example:
    >>> run = train(preset="gpt2_base_en", dataset="jsonl:train.jsonl", epochs=1)  # doctest: +SKIP
    """
    from trainwell import quick  # lazy: it imports Keras
    from trainwell.compat import build_before_fit, raw_learning_rate  # lazy: it imports Keras
    from trainwell.recipes import harness  # lazy: it imports Keras
    from trainwell.callbacks import StopAtStep  # lazy: the callbacks import Keras

    cfg = _cfg(cfg, overrides)
    with harness.setup_run(cfg, RECIPE) as ctx:  # a bad example below: the fresh run directory goes away
        preprocessor = build_preprocessor(cfg)
        data_ = build_data(cfg, preprocessor)
        steps = data_.steps_per_epoch
        train_ds = harness.advance_epochs(data_.train, harness.resume_epoch(harness.checkpoint_dir(ctx.run_dir)))
        runtime.use_backbone_layout(ctx.strategy, backbone_class(cfg))  # model_parallel:DxM: before the build
        with ctx.strategy.scope():
            model = build_model(cfg)
            if cfg.peak_lr is None:  # known once the model says LoRA or not; checkpoints and a divergence hint read it
                cfg.peak_lr = default_peak_lr(_lora_on(model))
            compile_model(cfg, model, steps)
        cbs = build_callbacks(cfg, ctx.run_dir, schedule=raw_learning_rate(model.optimizer), chief=ctx.is_chief,
                              lora=_lora_on(model))
        cbs += list(callbacks or ())
        total = phase_steps(cfg, steps)[0]
        epochs = -(-total // steps)
        if total < epochs * steps:
            cbs.append(StopAtStep(total))
        verbose = cfg.verbose if cfg.verbose == "auto" else int(cfg.verbose)
        build_before_fit(model, train_ds)
        with ctx.fit_scope():
            history = model.fit(train_ds, validation_data=data_.val, epochs=epochs, steps_per_epoch=steps,
                                callbacks=cbs, verbose=verbose, shuffle=False)
            trained = not harness.trained_nothing(history, ctx.run_dir)
            metrics = {}
            if trained:
                ev = model.evaluate(data_.val, verbose=verbose, return_dict=True, steps=quick.test_steps())
                metrics = {"eval_loss": float(ev["token_loss"]), "eval_perplexity": float(math.exp(ev["token_loss"])),
                           "eval_tokens": data_.val_tokens}
        model.preprocessor = preprocessor
        # Weights split between processes (model_parallel over --workers): every process takes part in
        # gathering them; the chief generates the samples and exports from a copy on its own device.
        spans = spans_processes(model)
        if trained and (ctx.is_chief or spans):
            local = merged_copy(model) if spans else model  # merged_copy gathers the split weights
            local.preprocessor = preprocessor
            if ctx.is_chief:
                write_samples(local, data_.held_out[: cfg.num_samples], ctx.run_dir / SAMPLES_FILE,
                              cfg.sequence_length)
                if cfg.export:
                    export = merged_copy(local) if _lora_on(local) else local
                    export.preprocessor = preprocessor
                    export.save_to_preset(str(ctx.run_dir / EXPORT_DIR))
        return harness.finish_run(ctx, cfg, model, metrics, history)


def write_samples(model, examples, path, max_length: int) -> Path:
    """Greedy generations of the examples' prompts (`model.generate`), one JSON object a line.

    Each line: `{"prompt", "reference", "generated"}`; `generated` is what follows the
    prompt (the whole output when the detokenized output does not start with it).

    Example:
    >>> write_samples(run.model, held_out[:3], run.run_dir / "samples.jsonl", 256)  # doctest: +SKIP
    """
    lines = []
    if examples:
        pairs = [instructions.prompt_and_reference(ex) for ex in examples]
        outputs = model.generate([p for p, _ in pairs], max_length=max_length)
        for (prompt, ref), out in zip(pairs, outputs):
            out = out.decode() if isinstance(out, bytes) else str(out)
            gen = out[len(prompt):] if out.startswith(prompt) else out
            lines.append(json.dumps({"prompt": prompt, "reference": ref, "generated": gen}))
    return atomic_write_text(path, "".join(line + "\n" for line in lines))


# --------------------------------------------------------------------------- hyperparameter search
def _tuning_space(hp, cfg: Config) -> dict:
    """Declares the search space on `hp` (defaults = `cfg`) and returns the config fields it sets."""
    from trainwell.recipes.hypermodel import log_float  # lazy: keras_tuner loads only for a search

    lora = cfg.lora != "off"  # "auto" may or may not train adapters: the rank is searched either way
    peak = cfg.peak_lr if cfg.peak_lr is not None else default_peak_lr(cfg.lora == "on")
    out = {
        "peak_lr": log_float(hp, "peak_lr", peak, 5.0),
        "weight_decay": log_float(hp, "weight_decay", cfg.weight_decay or 0.01, 10.0),
        "warmup_fraction": hp.Float("warmup_fraction", 0.0, max(0.1, cfg.warmup_fraction),
                                    default=cfg.warmup_fraction),
    }
    if lora:
        out["lora_rank"] = hp.Choice("lora_rank", sorted({4, 8, 16, cfg.lora_rank}), default=cfg.lora_rank)
    return out


def _tuning_build(cfg: Config):
    data_ = build_data(cfg, build_preprocessor(cfg))
    model = build_model(cfg)
    compile_model(cfg, model, data_.steps_per_epoch)
    return model


def _tuning_export(model, cfg: Config, run_dir, path):
    export = merged_copy(model) if _lora_on(model) else model
    export.preprocessor = build_preprocessor(cfg)
    export.save_to_preset(str(path))
    return Path(path)


def hypermodel(cfg: Config | None = None, **overrides):
    """A `keras_tuner.HyperModel` over this recipe (see `trainwell.tuning`), minimising `val_token_loss`.

    The space: peak LR (log, /5 to x5), weight decay (log), warmup fraction and, unless
    `lora="off"`, the LoRA rank (4, 8, 16 and the config's). A trial runs `train()` with
    `verbose=0`, no TrainingDoctor unless `doctor` is overridden, no samples and no
    per-trial export (the search exports the best trial's merged model).

    Example:
    >>> hm = hypermodel(dataset="jsonl:train.jsonl", validate_data=False)
    >>> hm.objective.name, hm.objective.direction
    ('val_token_loss', 'min')
    """
    from trainwell.recipes.hypermodel import recipe_hypermodel  # lazy: keras_tuner loads only for a search

    cfg = _cfg(cfg, overrides)
    trial = {"verbose": 0, "export": False, "num_samples": 0}
    if "doctor" not in overrides:
        trial["doctor"] = False
    return recipe_hypermodel(
        sys.modules[__name__], cfg, _tuning_space, build_fn=_tuning_build, export_fn=_tuning_export,
        trial_overrides=trial, objective="val_token_loss", direction="min", static=("batch_size",), name=RECIPE,
    )
