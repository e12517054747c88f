"""Fine-tuning a pretrained transformer for text classification, the BERT way.

Reads top to bottom: the `Config` (every default is the published recipe, with its
source), then `build_data`, `build_model`, `build_optimizer`, `build_callbacks`,
`train`, and `predict` for the exported model. Any keras-hub text classifier works:
a keras-hub preset name (`bert_base_en_uncased`, `roberta_base_en`,
`deberta_v3_base_en`, `distil_bert_base_en_uncased`, ...; downloaded by keras-hub), a
local preset directory in Keras or Hugging Face format, or `"minilm"` (the embedded
MiniLM-L6-H384, offline).

What the recipe adds to a plain `TextClassifier.from_preset(...).fit(...)`:

- AdamW with decoupled weight decay 0.01 not on LayerNorm and biases, a linear
  warmup over 10% of the steps then linear decay to 0, global gradient clipping at
  1.0, epsilon 1e-6 (BERT, TF Model Garden GLUE), instead of Adam at a constant 5e-5;
- early stopping on the validation accuracy with the best weights restored, and
  trainwell's restart-safe checkpoints (exact resume after a crash), NaN rollback
  and diagnostics;
- length-bucketed batches (`trainwell.data.text`): a batch is padded only up to its
  length bucket, not to `sequence_length` (Rotten Tomatoes at `sequence_length=64`: 32
  tokens per example on average instead of 64);
- options: layer-wise LR decay, freeze-then-unfreeze, gradient accumulation, mixed
  precision (head and loss in float32), `MirroredStrategy`, LoRA (`lora_rank`: the
  backbone frozen, adapters on its attention projections, the head trained in full;
  the export merges the adapters, `trainwell.models.lora`).

Layer-wise LR decay and freeze-then-unfreeze have no Keras built-in: both are a
learning-rate factor per variable in `trainwell.optimizers.LayerwiseAdamW` (an `AdamW` subclass). With
`layerwise_lr_decay=d`, the classifier head (and the pooler) learn at the full LR, the
top transformer layer at `d` times it, the one below at `d**2`, ..., the embeddings at
`d**(num_layers + 1)` (Clark et al. 2020, ELECTRA; Sun et al. 2019). With
`freeze_epochs=k`, the backbone's factor is 0 for the first `k` epochs (only the head
trains, at `head_lr`), then every variable trains on a fresh warmup-then-decay schedule
over the remaining steps (Howard & Ruder 2018; Kumar et al. 2022, LP-FT). A factor of
0 leaves a variable unchanged (no update, no weight decay) while its Adam moments keep
their statistics, so no recompilation is needed between the phases.

Example:
>>> from trainwell.recipes import transformer_finetune as tft
>>> run = tft.train(preset="minilm", dataset="rotten_tomatoes", epochs=1,
...                 sequence_length=64)  # doctest: +SKIP
>>> run.metrics["test_accuracy"]  # doctest: +SKIP
>>> tft.predict(["A triumph.", "Two hours I will never get back."], run_dir=run.run_dir)  # doctest: +SKIP
(['fresh', 'rotten'], array([[0.03, 0.97], [0.96, 0.04]], dtype=float32))
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from trainwell.config import (
    BaseConfig,
    check_dir_path,
    check_positive,
    check_range,
    check_reliability_fields,
    raise_invalid,
)
from trainwell.data import text
from trainwell.data.embedded import minilm_preset_dir
from trainwell.data.sources import check_preset, check_text_source
from trainwell.data.text import load_label_map, save_label_map
from trainwell.models.lora import enable_lora, merged_copy
from trainwell.recipes.transformer_serving import EXPORT_DIR, export_model, load_exported, predict  # noqa: F401 - the recipe's API
from trainwell.validation import invalid_argument

RECIPE = "transformer-finetune"
NO_DECAY_NAMES = ("gamma", "beta", "bias")  # LayerNorm scale/offset and biases [BERT]


@dataclasses.dataclass
class Config(BaseConfig):
    """Hyperparameters of the fine-tuning recipe; defaults = the published BERT recipe.

    Sources: [BERT] Devlin et al. 2019, sec. 4 and appendix A.3 (fine-tuning: batch 32,
    LR in {5e-5, 3e-5, 2e-5}, 2-4 epochs, warmup 10% then linear decay);
    [MG] TF Model Garden `official/nlp` GLUE fine-tuning configs (AdamW, weight decay
    0.01 excluding LayerNorm and bias, epsilon 1e-6, global clipnorm 1.0, sequence
    length 128); [ELECTRA] Clark et al. 2020 (layer-wise LR decay 0.8);
    [ULMFiT] Howard & Ruder 2018 and [LP-FT] Kumar et al. 2022 (train the head first);
    [Prechelt] early stopping with the best weights; [HF] Hugging Face Trainer
    (`group_by_length`); [LoRA] Hu et al. 2021 (rank 1-64 on the attention's query and
    value projections, the rest of the backbone frozen).

    Example:
    >>> c = Config()
    >>> (c.peak_lr, c.weight_decay, c.warmup_fraction, c.batch_size, c.epochs)
    (3e-05, 0.01, 0.1, 32, 3)
    """

    dataset: str = "rotten_tomatoes"  # embedded; "tfds:glue/sst2", "csv:PATH", "jsonl:PATH", ...
    epochs: int = 3  # [BERT] 2-4
    max_steps: Optional[int] = None  # [MG] trainer.train_steps, [HF] max_steps; None: epochs x steps/epoch
    batch_size: int = 32  # global batch; [BERT] 32, [MG] 32
    precision: str = "auto"  # mixed_float16 on GPUs >= 7.0; head and loss stay float32
    strategy: str = "auto"
    seed: int = 0
    run_dir: Optional[str] = None
    # -- model
    preset: str = "minilm"  # keras-hub preset name, local preset dir, or "minilm" (embedded)
    sequence_length: int = 128  # [MG] GLUE seq_length 128
    dropout: float = 0.1  # [BERT] classifier dropout 0.1
    lora_rank: Optional[int] = None  # None: full fine-tuning; [LoRA] 1-64 (8 is common), base weights frozen
    lora_alpha: Optional[float] = None  # adapters scaled by lora_alpha / lora_rank; None: lora_rank (Keras's default)
    lora_target_layers: Optional[list[str]] = None  # None: the backbone's default_lora_layer_names() (keras-hub: query, value)
    # -- data
    text_field: Optional[str] = None  # None: "text", "sentence", "review" or "content"
    label_field: str = "label"
    data_dir: Optional[str] = None  # TFDS data_dir / base of relative csv/jsonl paths
    val_fraction: float = 0.1  # carved from train when the source has no validation split
    test_fraction: float = 0.2  # carved from train when the source has no labelled test split
    split_seed: int = 0  # seed of the carved splits, apart from `seed`: the held-out set stays fixed
    max_train_examples: Optional[int] = None  # None: all (a cap for quick runs)
    bucket_by_length: bool = True  # [HF] group_by_length: pad each batch only to its bucket
    # -- optimisation
    peak_lr: float = 3e-5  # [BERT] grid {2e-5, 3e-5, 5e-5}
    weight_decay: float = 0.01  # [BERT], [MG]; decoupled, not on LayerNorm and biases
    beta_1: float = 0.9  # [BERT]
    beta_2: float = 0.999  # [BERT]
    epsilon: float = 1e-6  # [BERT], [MG]
    global_clipnorm: Optional[float] = 1.0  # [BERT] clip_by_global_norm 1.0, [MG]
    warmup_fraction: float = 0.1  # [BERT], [MG]: 10% of the steps
    schedule: Literal["linear", "cosine"] = "linear"  # [BERT] linear decay to 0; cosine optional
    min_lr: float = 0.0  # [BERT] decay to 0
    layerwise_lr_decay: float = 1.0  # 1.0 = off; [ELECTRA] 0.8 (base)
    freeze_epochs: float = 0.0  # 0 = off; epochs training the head only [ULMFiT], [LP-FT]
    head_lr: float = 1e-3  # LR of the head-only phase (Keras Adam's default LR)
    gradient_accumulation_steps: Optional[int] = None  # Keras optimizer built-in; None = off
    # -- performance
    jit_compile: Optional[bool] = None  # None: Keras's "auto" (XLA off on CPU)
    steps_per_execution: Optional[int] = None  # None: 8 on a GPU/TPU, 1 on CPUs (harness.steps_per_execution)
    # -- reliability
    checkpoint_every: str = "epoch"  # "epoch" or a number of steps
    keep_last: int = 3
    nan_rollback: bool = True
    snapshot_every: int = 100  # steps between NaN-rollback snapshots
    early_stopping_patience: Optional[int] = 1  # [Prechelt]; None: off; best weights restored
    doctor: bool = True  # TrainingDoctor at low overhead settings
    deterministic: bool = False  # op determinism (slower); needed for bit-exact resume
    export: bool = True  # save the model (keras-hub preset) and labels to RUN_DIR/model
    verbose: Literal["auto", 0, 1, 2] = "auto"  # Keras fit verbosity ("0" on the command line is 0)

    def validate(self) -> None:
        super().validate()
        if not self.preset.strip():
            raise_invalid("preset", self.preset, "a keras-hub preset name, a preset directory or 'minilm'")
        if self.sequence_length < 8:
            raise_invalid("sequence_length", self.sequence_length, "an integer >= 8")
        check_range(self, "dropout", 0.0, 1.0, hi_open=True)
        if self.lora_rank is not None and self.lora_rank < 1:
            raise_invalid("lora_rank", self.lora_rank, "null (full fine-tuning) or an integer >= 1")
        check_positive(self, "lora_alpha")
        if self.lora_alpha is not None and self.lora_rank is None:
            raise_invalid("lora_alpha", self.lora_alpha, "null when lora_rank is null (no LoRA to scale)")
        if self.lora_target_layers is not None:
            if self.lora_rank is None:
                raise_invalid("lora_target_layers", self.lora_target_layers, "null when lora_rank is null")
            if not self.lora_target_layers or not all(str(n).strip() for n in self.lora_target_layers):
                raise_invalid("lora_target_layers", self.lora_target_layers, "null or a non-empty list of layer names")
        if not self.label_field.strip():
            raise_invalid("label_field", self.label_field, "a non-empty field name")
        check_range(self, "val_fraction", 0.0, 1.0, hi_open=True)
        check_range(self, "test_fraction", 0.0, 1.0, hi_open=True)
        if self.val_fraction + self.test_fraction >= 1:
            raise_invalid("test_fraction", self.test_fraction, f"val_fraction + test_fraction < 1 (val_fraction={self.val_fraction})")
        if self.split_seed < 0:
            raise_invalid("split_seed", self.split_seed, "an integer >= 0")
        check_positive(self, "max_train_examples")
        if self.max_train_examples is not None and self.batch_size > self.max_train_examples:
            raise_invalid("batch_size", self.batch_size, f"at most max_train_examples={self.max_train_examples}")
        check_positive(self, "max_steps")
        check_positive(self, "peak_lr")
        check_positive(self, "weight_decay", allow_zero=True)
        check_range(self, "beta_1", 0.0, 1.0, hi_open=True)
        check_range(self, "beta_2", 0.0, 1.0, hi_open=True)
        check_positive(self, "epsilon")
        check_positive(self, "global_clipnorm")
        check_range(self, "warmup_fraction", 0.0, 1.0, hi_open=True)
        check_range(self, "min_lr", 0.0, self.peak_lr)
        check_range(self, "layerwise_lr_decay", 0.0, 1.0, lo_open=True)
        check_positive(self, "freeze_epochs", allow_zero=True)
        if self.freeze_epochs >= self.epochs:
            raise_invalid("freeze_epochs", self.freeze_epochs, f"fewer than epochs={self.epochs}")
        check_positive(self, "head_lr")
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 2:
            raise_invalid("gradient_accumulation_steps", self.gradient_accumulation_steps, "null or an integer >= 2")
        check_reliability_fields(self)

        check_preset(self.preset)
        check_dir_path(self.data_dir, "data_dir")  # a file, or a directory this process cannot read
        check_text_source(self.dataset, self.data_dir, self.text_field, self.label_field)  # CSV/JSONL: parsed


def _cfg(cfg: Config | None, overrides: dict) -> Config:
    if cfg is None:
        return Config(**overrides)
    return cfg.replace(**overrides) if overrides else cfg


# --------------------------------------------------------------------------- model
def resolve_preset(preset: str) -> str:
    """The keras-hub preset handle of `preset`: `"minilm"` -> the embedded directory.

    A local directory is returned as an absolute path; anything else is a keras-hub
    preset name (or `kaggle://` / `hf://` handle) that keras-hub downloads.

    Example:
    >>> resolve_preset("bert_base_en_uncased")
    'bert_base_en_uncased'
    """
    if preset == "minilm":

        return str(minilm_preset_dir())
    p = Path(preset).expanduser()
    if p.is_dir():
        return str(p.resolve())
    if preset.startswith((".", "/", "~")) or os.sep in preset and "://" not in preset:
        raise FileNotFoundError(f"Preset directory not found: {preset!r}")
    return preset


def build_preprocessor(cfg: Config):
    """The preset's text classifier preprocessor (tokeniser) at `cfg.sequence_length`.

    Example:
    >>> pre = build_preprocessor(Config(sequence_length=64))  # doctest: +SKIP
    >>> pre(["a fine film"])["token_ids"].shape  # doctest: +SKIP
    TensorShape([1, 64])
    """
    # lazy: keras-hub loads on first use, not with this module
    import keras_hub

    return keras_hub.models.TextClassifierPreprocessor.from_preset(
        resolve_preset(cfg.preset), sequence_length=cfg.sequence_length
    )


def build_model(cfg: Config, num_classes: int):
    """The preset's `TextClassifier` with `num_classes` outputs (logits), no preprocessor.

    The backbone follows the global dtype policy; under mixed precision the head
    (every layer outside the backbone: dropout, logits) computes in float32, so the
    logits and the loss are float32. Tokenisation runs in the input pipeline
    (`trainwell.data.text`); `export_model` attaches the preprocessor for inference.
    With `cfg.lora_rank`, the backbone is frozen and LoRA adapters are added to its
    `cfg.lora_target_layers` (`trainwell.models.lora.enable_lora`); the head (every
    layer outside the backbone) stays fully trainable.

    Example:
    >>> model = build_model(Config(), num_classes=2)  # doctest: +SKIP
    """
    # lazy: Keras loads on first use, not with this module
    import keras
    import keras_hub

    policy = keras.config.dtype_policy().name
    model = keras_hub.models.TextClassifier.from_preset(
        resolve_preset(cfg.preset), num_classes=int(num_classes), preprocessor=None,
        dropout=cfg.dropout, dtype=policy,
    )
    if policy != "float32":
        for layer in model.layers:
            if layer is model.backbone or isinstance(layer, keras.layers.InputLayer):
                continue
            layer.dtype_policy = "float32"
    if cfg.lora_rank is not None:
        enable_lora(model.backbone, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_layers)
    return model


def layerwise_lr_scales(model, decay: float) -> dict[str, float]:
    """LR factor of each trainable variable (by path) for layer-wise LR decay.

    Depth from the top: the head and the pooler 0 (factor 1), transformer layer `i`
    of `L` (a path with `layer_<i>/`) `L - i`, the embeddings `L + 1`; the factor is
    `decay ** depth` [ELECTRA].

    Args:
        model: A keras-hub task with a `backbone`.
        decay: Factor per layer, in (0, 1].

    Returns:
        `{variable.path: factor}` for every trainable variable.

    Example:
    >>> scales = layerwise_lr_scales(model, 0.8)  # doctest: +SKIP
    >>> scales["logits/kernel"], scales["transformer_layer_5/self_attention_layer/query/kernel"]  # doctest: +SKIP
    (1.0, 0.8)
    """
    if not 0 < decay <= 1:
        raise invalid_argument("decay", "a float in (0, 1]", decay)
    backbone = model.backbone
    in_backbone = {id(v) for v in backbone.trainable_variables}
    layer_re = re.compile(r"(?:^|/|_)layer_(\d+)(?:/|$)")
    indices = [int(m.group(1)) for v in backbone.trainable_variables if (m := layer_re.search(v.path))]
    num_layers = int(getattr(backbone, "num_layers", 0) or (max(indices) + 1 if indices else 0))
    scales = {}
    for v in model.trainable_variables:
        depth = 0
        if id(v) in in_backbone:
            m = layer_re.search(v.path)
            if m:
                depth = num_layers - int(m.group(1))
            elif "embedding" in v.path:
                depth = num_layers + 1
        scales[v.path] = float(decay) ** depth
    return scales


# --------------------------------------------------------------------------- data
def build_data(cfg: Config, preprocessor, data: Any = None):
    """The tokenising train/val/test pipelines (`trainwell.data.text`).

    Args:
        cfg: The config.
        preprocessor: From `build_preprocessor`.
        data: In-memory data instead of `cfg.dataset`: `(texts, labels)` or
            `{"train": (texts, labels), "val": ..., "test": ...}`. Defaults to `None`.

    Example:
    >>> data = build_data(Config(sequence_length=64), build_preprocessor(Config(sequence_length=64)))  # doctest: +SKIP
    >>> data.class_names  # doctest: +SKIP
    ['rotten', 'fresh']
    """

    splits = text.load_text_splits(
        cfg.dataset if data is None else data,
        text_field=cfg.text_field, label_field=cfg.label_field, val_fraction=cfg.val_fraction,
        test_fraction=cfg.test_fraction, seed=cfg.split_seed, data_dir=cfg.data_dir,
        max_train_examples=cfg.max_train_examples,
    )
    return text.build_text_datasets(
        splits, preprocessor, cfg.batch_size, sequence_length=cfg.sequence_length, seed=cfg.seed,
        bucket_by_length=cfg.bucket_by_length,
    )


# --------------------------------------------------------------------------- optimiser
def phase_steps(cfg: Config, steps_per_epoch: int) -> tuple[int, int, int]:
    """`(total, freeze, warmup)` steps: the run, the head-only phase, the warmup after it.

    `cfg.max_steps` caps the total: the schedule then reaches its end there and
    `train` stops at that step, inside the last epoch.

    Example:
    >>> phase_steps(Config(epochs=3), 100)
    (300, 0, 30)
    >>> phase_steps(Config(epochs=3, max_steps=180), 100)
    (180, 0, 18)
    """
    total = max(1, cfg.epochs * int(steps_per_epoch))
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    freeze = min(total - 1, int(round(cfg.freeze_epochs * steps_per_epoch))) if cfg.freeze_epochs else 0
    warmup = int(round(cfg.warmup_fraction * (total - freeze)))
    return total, freeze, warmup


def fit_epochs(cfg: Config, steps_per_epoch: int) -> tuple[int, int]:
    """`(epochs, steps_per_epoch)` for `fit`: the run's steps, so the progress bar shows them.

    A run that `max_steps` ends inside its first epoch is one epoch of `max_steps`
    steps (the bar counts to 20, not to the 279 batches of the data); a longer one
    keeps the data's epochs and stops inside the last (`StopAtStep`).

    Example:
    >>> fit_epochs(Config(epochs=3, max_steps=20), 279)
    (1, 20)
    >>> fit_epochs(Config(epochs=3, max_steps=300), 279)
    (2, 279)
    """
    total = phase_steps(cfg, steps_per_epoch)[0]
    steps = min(int(steps_per_epoch), total)
    return -(-total // steps), steps


def build_optimizer(cfg: Config, steps_per_epoch: int, model=None):
    """AdamW on warmup-then-linear (or cosine) decay, with per-variable LR factors.

    Weight decay is decoupled and not applied to LayerNorm parameters and biases
    (`exclude_from_weight_decay`, a Keras built-in); gradients are clipped by their
    global norm and optionally accumulated (Keras built-ins). The schedule is a
    trainwell `WarmupLinearDecay` / `WarmupCosineDecay`, whose LR multiplier lets NaN
    rollback lower the LR of the built optimizer. `model` is needed for layer-wise LR
    decay and freeze-then-unfreeze (to find the layers and the backbone).

    Example:
    >>> opt = build_optimizer(Config(), steps_per_epoch=280)  # doctest: +SKIP
    """
    # lazy: Keras loads when an optimizer is built, not when the recipe is imported
    from trainwell.callbacks.schedules import WarmupCosineDecay, WarmupLinearDecay
    from trainwell.optimizers import LayerwiseAdamW

    total, freeze, warmup = phase_steps(cfg, steps_per_epoch)
    cls = WarmupLinearDecay if cfg.schedule == "linear" else WarmupCosineDecay
    lr = cls(cfg.peak_lr, total_steps=total - freeze, warmup_steps=warmup, min_lr=cfg.min_lr)
    scales, frozen = {}, []
    if cfg.layerwise_lr_decay != 1.0 or freeze:
        if model is None:
            raise ValueError("build_optimizer needs the model for layer-wise LR decay or freeze_epochs.")
        if cfg.layerwise_lr_decay != 1.0:
            scales = layerwise_lr_scales(model, cfg.layerwise_lr_decay)
        if freeze:
            frozen = [v.path for v in model.backbone.trainable_variables]
    opt = LayerwiseAdamW(
        learning_rate=lr, weight_decay=cfg.weight_decay, beta_1=cfg.beta_1, beta_2=cfg.beta_2,
        epsilon=cfg.epsilon, global_clipnorm=cfg.global_clipnorm,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        lr_scales=scales, frozen_variables=frozen, freeze_steps=freeze, head_lr=cfg.head_lr,
    )
    opt.exclude_from_weight_decay(var_names=list(NO_DECAY_NAMES))
    return opt


def compile_model(cfg: Config, model, steps_per_epoch: int) -> None:
    """Compiles `model` with the recipe's optimizer, logits loss, accuracy, XLA and spe settings.

    Example:
    >>> compile_model(Config(), model, steps_per_epoch=280)  # doctest: +SKIP
    """
    # lazy: Keras loads on first use, not with this module
    import keras

    from trainwell.recipes.harness import steps_per_execution  # lazy, as the recipe's other harness uses

    model.compile(
        optimizer=build_optimizer(cfg, steps_per_epoch, model),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # weighted: a short last evaluation batch padded with zero-weighted examples (JAX data
        # parallelism, trainwell/data/batches.py) is not counted; the same values everywhere else
        weighted_metrics=["accuracy"],
        metrics=[],  # not keras-hub's "auto" (a second, unweighted accuracy)
        jit_compile="auto" if cfg.jit_compile is None else cfg.jit_compile,
        steps_per_execution=steps_per_execution(cfg.steps_per_execution),
    )


def lr_find_setup(cfg: Config):
    """A compiled model and the training data, for `trainwell lr-find`.

    The model is compiled as `train` compiles it (AdamW, its per-variable LR factors,
    clipping); the LR finder replaces the learning rate schedule while it runs.

    Example:
    >>> model, data = lr_find_setup(Config(preset="minilm", sequence_length=64))  # doctest: +SKIP
    """
    data_ = build_data(cfg, build_preprocessor(cfg))
    model = build_model(cfg, data_.num_classes)
    compile_model(cfg, model, data_.steps_per_epoch or 1)
    return model, data_.train


class _EffectiveSchedule:
    """The LR over the whole run with a head-only phase (for `lr_schedule.png`)."""

    def __init__(self, schedule, freeze_steps: int, head_lr: float):
        self.schedule, self.freeze_steps, self.head_lr = schedule, freeze_steps, head_lr
        self.total_steps = schedule.total_steps + freeze_steps

    def __call__(self, step):
        return self.head_lr if step < self.freeze_steps else float(self.schedule(step - self.freeze_steps))


# --------------------------------------------------------------------------- callbacks
def build_callbacks(cfg: Config, run_dir, schedule=None, chief: bool = True, has_val: bool = True) -> list:
    """trainwell's reliability stack plus TensorBoard and CSVLogger for a run directory.

    Early stopping and the best checkpoint follow `val_accuracy` (`accuracy` when there
    is no validation data, and then no early stopping).

    Args:
        cfg: The config.
        run_dir: The run directory.
        schedule: The optimizer's LR schedule (logged and plotted). Defaults to `None`.
        chief: Whether this process writes the run directory. Defaults to `True`.
        has_val: Whether `fit` gets validation data. Defaults to `True`.

    Example:
    >>> cbs = build_callbacks(Config(), "/tmp/run")  # doctest: +SKIP
    """
    # lazy: it imports Keras/TensorFlow; loaded on first use, not with this module
    from trainwell.recipes.harness import standard_callbacks

    return standard_callbacks(
        cfg, run_dir,
        monitor="val_accuracy" if has_val else "accuracy", mode="max",
        schedule=schedule,
        checkpoint_every=cfg.checkpoint_every,
        keep_last=cfg.keep_last,
        nan_rollback=cfg.nan_rollback,
        snapshot_every=cfg.snapshot_every,
        early_stopping_patience=cfg.early_stopping_patience if has_val else None,
        warmup_epochs=int(math.ceil(cfg.freeze_epochs)),
        doctor=cfg.doctor,
        chief=chief,
        # LoRA: checkpoints hold what trains (adapters, head, optimizer slots), not the frozen base
        frozen_weights="non_trainable" if cfg.lora_rank is not None else None,
    )


# --------------------------------------------------------------------------- train
def train(cfg: Config | None = None, data: Any = None, *, callbacks=None, model_hook=None, segment: bool = False,
          **overrides):
    # one piece: a run's steps in their order inside one `setup_run` scope: data, model, callbacks, fit, test, export
    """Fine-tunes the recipe and returns a `trainwell.recipes.harness.RunResult`.

    Args:
        cfg: A `Config`. Defaults to `None` (the published defaults).
        data: In-memory data instead of `cfg.dataset` (see `build_data`); the config
            then records `dataset="memory"`. Defaults to `None`.
        callbacks: Extra Keras callbacks, run after the recipe's own (e.g. a
            KerasTuner reporter). Defaults to `None`.
        model_hook: `model_hook(factory) -> factory`, wrapping the function that
            builds and compiles the run's model (`factory(cfg) -> model`): how a
            PBT search hands a member the model it kept from its previous segment
            (see `trainwell.recipes.hypermodel.recipe_model_hook`). Defaults to `None`.
        segment: The run is one segment of a longer one, continued later (a PBT or
            Hyperband segment): the test evaluation, the export and `curves.png` are
            skipped (nothing reads them before the last segment). Defaults to `False`.
        **overrides: Config fields to change, e.g. `epochs=1`.

    Returns:
        `RunResult(model, history, metrics, run_dir, config)`; `metrics` holds the test
        split's `test_loss` and `test_accuracy`. `model` has the preprocessor attached
        (it takes raw strings); with `cfg.export` it is saved to `RUN_DIR/model` with
        the label mapping (`labels.json`, also in `RUN_DIR`).

    Example:
    >>> run = train(preset="minilm", epochs=1, sequence_length=64)  # doctest: +SKIP
    """
    # lazy: the harness and the quick switch import Keras; loaded when training starts
    from trainwell import quick
    from trainwell.compat import build_before_fit, inner_optimizer, raw_learning_rate
    from trainwell.recipes import harness  # lazy: it imports Keras
    from trainwell.callbacks import StopAtStep, WarmupCosine  # lazy: the callbacks import Keras

    if data is not None:
        overrides = {**overrides, "dataset": "memory"}
    cfg = _cfg(cfg, overrides)
    with harness.setup_run(cfg, RECIPE) as ctx:  # releases the run dir's lock at the end
        preprocessor = build_preprocessor(cfg)
        data_ = build_data(cfg, preprocessor, data)
        steps = data_.steps_per_epoch
        # Exact resume: the resumed epoch sees the same order as it would have.
        train_ds = harness.advance_epochs(data_.train, harness.resume_epoch(harness.checkpoint_dir(ctx.run_dir)))

        def build_compiled(cfg: Config):
            model = build_model(cfg, data_.num_classes)
            compile_model(cfg, model, steps)
            return model

        with ctx.strategy.scope():
            model = (model_hook(build_compiled) if model_hook is not None else build_compiled)(cfg)
        if ctx.is_chief:
            save_label_map(ctx.run_dir, data_.class_names)
        inner = inner_optimizer(model.optimizer)
        schedule = raw_learning_rate(model.optimizer)
        if inner.freeze_steps:
            schedule = _EffectiveSchedule(schedule, inner.freeze_steps, cfg.head_lr)
        callbacks = build_callbacks(
            cfg, ctx.run_dir, schedule=schedule, chief=ctx.is_chief, has_val=data_.val is not None
        ) + list(callbacks or ())
        if not any(isinstance(c, WarmupCosine) for c in callbacks):
            # The LR in the history, as Keras's LearningRateScheduler logs it (WarmupCosine
            # does it for its own schedule); before the loggers, which write the logs.
            callbacks.insert(0, harness.log_learning_rate(model))
        # Under a strategy, `runtime.make_strategy` (in `harness.setup_run`) applied keras_fixes'
        # "symbolic_build" (Keras would MEAN-reduce a per-replica batch, boolean padding masks included).
        total = phase_steps(cfg, steps)[0]
        epochs, epoch_steps = fit_epochs(cfg, steps)
        if total < epochs * epoch_steps:
            callbacks.append(StopAtStep(total))
        verbose = cfg.verbose if cfg.verbose == "auto" else int(cfg.verbose)
        build_before_fit(model, train_ds)  # one trace on TF; on JAX the k-th iterator stays the k-th epoch
        with ctx.fit_scope():  # JAX: fit reads the distribution when called
            history = model.fit(
                train_ds, validation_data=data_.val, epochs=epochs, steps_per_epoch=epoch_steps,
                callbacks=callbacks, verbose=verbose, shuffle=False,  # the pipeline shuffles (seeded)
            )
            test = {}
            trained = not harness.trained_nothing(history, ctx.run_dir)  # a resume with no epoch left: nothing to redo
            if data_.test is not None and not segment and trained:
                _say(cfg, f"Evaluating on the test split ({len(data_.splits.test[1])} examples) ...")
                test = model.evaluate(data_.test, verbose=verbose, return_dict=True,
                                      steps=quick.test_steps())  # TRAINWELL_QUICK: a few test batches
        metrics = {f"test_{k}": v for k, v in test.items()}
        if cfg.export and ctx.is_chief and not segment and trained:
            _say(cfg, f"Exporting the model and its tokenizer to {ctx.run_dir / EXPORT_DIR} ...")
            export_model(_plain(model), preprocessor, data_.class_names, ctx.run_dir / EXPORT_DIR)
        model.preprocessor = preprocessor
        return harness.finish_run(ctx, cfg, model, metrics, history, plots=not segment)


def _plain(model):
    """`model` itself, or with LoRA its merged copy: the export loads in plain keras-hub, without adapters."""
    return merged_copy(model) if any("lora_" in v.path for v in model.weights) else model


def _say(cfg: Config, message: str) -> None:
    """One line on what the run does next (not with `verbose=0`)."""
    if str(cfg.verbose) != "0":
        print(message, flush=True)


# --------------------------------------------------------------------------- hyperparameter search
def _tuning_space(hp, cfg: Config) -> dict:
    """Declares the search space on `hp` (defaults = `cfg`) and returns the config fields it sets.

    No label smoothing (this recipe's sparse cross-entropy has none) and no
    optimizer choice (the recipe is AdamW with per-variable LR factors).
    """
    from trainwell.recipes.hypermodel import batch_size_choice, log_float  # lazy: keras_tuner loads only for a search

    peak_lr = log_float(hp, "peak_lr", cfg.peak_lr, 5.0)
    weight_decay = log_float(hp, "weight_decay", cfg.weight_decay or 0.01, 10.0)
    # ranges widen to hold the config's own value, so the defaults give back the config
    warmup = hp.Float("warmup_fraction", 0.0, max(0.3, cfg.warmup_fraction), default=cfg.warmup_fraction)
    dropout = hp.Float("dropout", 0.0, max(0.3, cfg.dropout), default=cfg.dropout)
    batch = batch_size_choice(hp, cfg.batch_size, limit=cfg.max_train_examples)
    lld = hp.Float("layerwise_lr_decay", min(0.5, cfg.layerwise_lr_decay), 1.0, default=cfg.layerwise_lr_decay)
    lora = {}
    if cfg.lora_rank is not None:  # a LoRA config searches the rank too; full fine-tuning stays full
        lora["lora_rank"] = hp.Choice("lora_rank", sorted({4, 8, 16, cfg.lora_rank}), default=cfg.lora_rank)
    return {
        **lora,
        "peak_lr": peak_lr,
        "min_lr": min(cfg.min_lr, peak_lr),
        "weight_decay": weight_decay,
        "warmup_fraction": warmup,
        "dropout": dropout,
        "batch_size": batch,
        "layerwise_lr_decay": lld,
    }


def _tuning_build(cfg: Config):
    data_ = build_data(cfg, build_preprocessor(cfg))
    model = build_model(cfg, data_.num_classes)
    compile_model(cfg, model, data_.steps_per_epoch or 1)
    return model


def _tuning_export(model, cfg: Config, run_dir, path):

    return export_model(_plain(model), build_preprocessor(cfg), load_label_map(run_dir), path)


def hypermodel(cfg: Config | None = None, **overrides):
    """A `keras_tuner.HyperModel` over this recipe (see `trainwell.tuning`).

    The space: peak LR (log, /5 to x5 of the config's), weight decay (log), warmup
    fraction, classifier dropout, batch size (half, same, double) and layer-wise LR
    decay, each defaulting to the config; with `lora_rank` set, the LoRA rank too
    (4, 8, 16 and the config's). A trial runs `train()` in its own run
    directory with the recipe's callbacks (NaN rollback, early stopping,
    checkpoints), `verbose=0`, no TrainingDoctor unless `doctor` is overridden
    and no per-trial export (the search exports the best trial's model, with its
    tokenizer, to `best_model/`); it reports `val_accuracy`.

    Example:
    >>> from trainwell import tuning
    >>> hm = hypermodel(preset="minilm", epochs=3, sequence_length=64)
    >>> result = tuning.search(hm, "random", max_trials=8)  # doctest: +SKIP
    """

    from trainwell.recipes.hypermodel import recipe_hypermodel  # lazy: keras_tuner loads only for a search

    cfg = _cfg(cfg, overrides)
    trial = {"verbose": 0, "export": False}
    if "doctor" not in overrides:
        trial["doctor"] = False
    return recipe_hypermodel(
        sys.modules[__name__], cfg, _tuning_space, build_fn=_tuning_build, export_fn=_tuning_export,
        trial_overrides=trial, objective="val_accuracy", direction="max", static=("batch_size",), name=RECIPE,
    )
