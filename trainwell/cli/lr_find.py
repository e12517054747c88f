"""`trainwell lr-find`: the LR range test on a recipe, and writing its suggestion into a config file.

The range test itself is `trainwell.callbacks.lr_finder.lr_find`; this module is the
command's part: which recipe functions give the model and data, which config field
takes the suggestion (`lr_config_updates`), what is printed, and rewriting the
config file (`write_config_value`). `trainwell.cli` re-exports the public names.

Example:
>>> from types import SimpleNamespace
>>> lr_config_updates(SimpleNamespace(), SimpleNamespace(epochs=3, lr=0.1), 0.02)  # a recipe without `lr_to_config`
{'lr': 0.02}
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from trainwell import rundir, runtime
from trainwell.config import ConfigError, os_error_reason, override_text
from trainwell.io import atomic_write_json, atomic_write_text

__all__ = ["CLI_METHOD", "CLI_PROBE_SCHEDULE", "LR_FIELDS", "lr_field", "lr_find_main", "lr_config_updates",
           "write_config_value"]

#: The suggestion `trainwell lr-find` prints and writes, with warmup + cosine probes:
#: the recipes use it as the peak of warmup + decay (figures: `bench/lr_finder_quality.py`
#: and the README).
CLI_METHOD = "probe"

#: The probes' schedule in `trainwell lr-find`: the recipes' shape.
CLI_PROBE_SCHEDULE = "warmup_cosine"

#: Config fields `lr_find_main` writes the suggestion into, in order of preference
#: (a recipe overrides with a module attribute `LR_FIELD`).
LR_FIELDS = ("peak_lr", "learning_rate", "lr", "base_lr")


def _train_split(data):
    """The training part of what a recipe's `build_data` returned."""
    try:
        # lazy: TensorFlow loads on first use, not with this module
        import tensorflow as tf

        ds_type = (tf.data.Dataset,)
    except ImportError:  # pragma: no cover
        ds_type = ()
    if isinstance(data, dict) and "train" in data:
        return data["train"]
    if hasattr(data, "train"):
        return data.train
    if isinstance(data, (tuple, list)) and data and (isinstance(data[0], ds_type) or hasattr(data[0], "__len__") and isinstance(data[0], (tuple, list))):
        return data[0]
    return data


def lr_field(recipe_module, cfg) -> str | None:
    """The config field that holds the recipe's learning rate: `LR_FIELD`, else the first of `LR_FIELDS` it has.

    Example:
    >>> from types import SimpleNamespace
    >>> lr_field(SimpleNamespace(), SimpleNamespace(epochs=3, lr=0.1))
    'lr'
    """
    names = [f.name for f in dataclasses.fields(cfg)] if dataclasses.is_dataclass(cfg) else list(vars(cfg))
    field = getattr(recipe_module, "LR_FIELD", None)
    if field:
        return field if field in names else None
    return next((f for f in LR_FIELDS if f in names), None)


def write_config_value(path: str | os.PathLike, key: str, value: Any, comment: str | None = None) -> Path:
    """Sets a top-level `key: value` in a YAML (or JSON) config file, keeping its comments.

    The file is rewritten atomically. In YAML, an existing top-level line for the key
    is replaced in place, its trailing comment kept unless `comment` is given;
    otherwise the key is appended.

    Args:
        path: The config file. Required.
        key: The top-level key. Required.
        value: Its new value. Required.
        comment: YAML only: the comment to write after the value, replacing the
            line's old one (which may describe the old value). Defaults to
            `None`: keep the old comment.

    Example:
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "c.yaml"; _ = p.write_text("epochs: 3  # short\\nlr: 0.1  # x 2\\n")
    >>> print(write_config_value(p, "lr", 0.02, comment="found by lr-find").read_text(), end="")
    epochs: 3  # short
    lr: 0.02  # found by lr-find
    """

    p = Path(path)
    text = p.read_text(encoding="utf-8") if p.exists() else ""
    if p.suffix.lower() == ".json":
        data = json.loads(text) if text.strip() else {}
        data[key] = value
        return atomic_write_json(p, data)
    rendered = repr(float(value)) if isinstance(value, float) else json.dumps(value)
    new_comment = None if comment is None else f"  # {comment}"
    pat = re.compile(rf"^({re.escape(key)}\s*:\s*)([^#\n]*?)(\s+#.*)?$", re.M)
    if pat.search(text):
        keep = lambda m: m.group(3) or ""  # noqa: E731
        text = pat.sub(lambda m: f"{m.group(1)}{rendered}{keep(m) if new_comment is None else new_comment}", text, count=1)
    else:
        if text and not text.endswith("\n"):
            text += "\n"
        text += f"{key}: {rendered}{new_comment or ''}\n"
    return atomic_write_text(p, text)


def lr_find_main(recipe_module, cfg, args) -> int:
    # one piece: a 44-line docstring (the recipe protocol); the body is the command, top to bottom
    """`trainwell lr-find RECIPE`: runs the LR range test on a recipe's model and data.

    The protocol a recipe module follows (the first that applies):

    1. `lr_find_setup(cfg) -> (model, train_data)`: a compiled model and its
       training data; full control.
    2. Otherwise `build_data(cfg)` then `build_model(cfg)` (or
       `build_model(cfg, data)` when it takes a second required argument). The
       training split is `data["train"]`, `data.train`, `data[0]` of a tuple of
       datasets, or `data` itself. A model that is not compiled is compiled with
       `compile_model(cfg, model)` if the recipe has it.

    The suggestion goes into the config field `recipe_module.LR_FIELD`, else the
    first of `peak_lr`, `learning_rate`, `lr`, `base_lr` the config has; a recipe
    whose field is not the peak LR itself (e.g. a base LR scaled by the batch
    size) defines `lr_to_config(cfg, peak_lr) -> {field: value}`; the command
    prints those fields as `--set` options (`lr_config_updates`). The curve is
    written to `RUN_DIR/lr_find.png` and `lr_find.json` (`cfg.run_dir`, else a new
    `runs/lr-find-...` directory); the directory is made (and checked) before the
    test runs, and one made here is removed again if the test fails.

    Args:
        recipe_module: The recipe module. Required.
        cfg: Its resolved `Config`. Required.
        args: The parsed command line: `write` (bool), `config` (path or None),
            `dry_run` (bool), `method` (the suggestion; default `CLI_METHOD`,
            "probe", with probes that run the recipes' warmup + cosine schedule,
            since the recipes use the LR as its peak), `probe_steps` (int or None:
            the range test's steps), `verbose` (0, 1 or 2, as `lr_find`'s; absent:
            1). Required.

    Returns:
        The exit status: 0, or 1 when there is no reliable suggestion (the loss
        was non-finite from the start, or `result.reliable` is `False`): it says
        why and what to try, and writes nothing into the config (the curve and
        `lr_find.json` are still written). Non-zero so that a script such as
        `trainwell lr-find ... --write && trainwell train ...` does not go on as
        if the LR had been found.

    Example:
    >>> lr_find_main(resnet_imagenet, cfg, args)  # doctest: +SKIP
    Suggested peak learning rate (probe): 0.158   [...]
    To train with it: --set base_lr=0.0395  (a peak LR of 0.158 at batch_size=1024)
    """

    write, config_path = bool(getattr(args, "write", False)), getattr(args, "config", None)
    method = getattr(args, "method", None) or CLI_METHOD
    probe_steps = getattr(args, "probe_steps", None)
    _check_arguments(recipe_module, cfg, write, config_path, method, probe_steps)
    if getattr(args, "dry_run", False):
        print(f"lr-find on {getattr(recipe_module, '__name__', 'recipe')}: config {cfg}")
        fields = ", ".join(lr_config_updates(recipe_module, cfg, 1.0)) or lr_field(recipe_module, cfg)
        print(f"would write the suggestion into {config_path}:{fields}" if write else "would print the suggestion")
        return 0

    # lazy: the LR finder imports Keras and TensorFlow; a dry run or a config error never loads them
    from trainwell.callbacks import lr_finder

    strategy = runtime.make_strategy(getattr(cfg, "strategy", "auto"))
    # The output directory first: one that cannot be made or written is a one-line error
    # before the range test runs, not after it; one made here is removed again if the run fails.
    given = getattr(cfg, "run_dir", None)
    made = given is None or not os.path.lexists(given)
    run_dir = rundir.make_run_dir(given, prefix="lr-find")
    try:
        result = _run_lr_find(recipe_module, cfg, args, strategy, method, probe_steps, lr_finder)
    except BaseException:
        if made and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()
        raise
    if result is None or result.suggestion is None:
        if made and not any(run_dir.iterdir()):
            run_dir.rmdir()
        print("The LR range test recorded no usable loss (the loss was non-finite from the start).")
        return 1
    _print_result(result)
    if runtime.is_chief(strategy):
        result.plot(run_dir / "lr_find.png")
        atomic_write_json(run_dir / "lr_find.json", result.to_dict())
        print(f"Curve: {run_dir / 'lr_find.png'}")
    if not result.reliable:
        longer = f"--probe-steps {4 * (result.probe_steps or len(result.lrs))}"
        tries = (f"longer probes ({longer})" if result.method == "probe" or result.probes
                 else "--method probe (short runs at candidate LRs)")
        print(f"Try {tries}, or check the data and labels (the model must be able to fit them); "
              + (f"nothing was written to {config_path}." if write else "nothing to write."))
        return 1
    value = float(f"{result.suggestion:.3g}")
    updates = lr_config_updates(recipe_module, cfg, value)
    if updates:
        print("To train with it: " + " ".join(f"--set {k}={override_text(v)}" for k, v in updates.items())
              + _lr_note(recipe_module, cfg, updates, value))
    return _write_suggestion(cfg, config_path, updates, value, result.method) if write else 0


def _check_arguments(recipe_module, cfg, write: bool, config_path, method: str, probe_steps) -> None:
    """Everything `lr_find_main` can refuse before it loads TensorFlow: one `ConfigError` line each."""
    if probe_steps is not None and (not isinstance(probe_steps, int) or isinstance(probe_steps, bool) or probe_steps < 2):
        raise ConfigError(f"`--probe-steps` must be an integer >= 2. Received: probe_steps={probe_steps!r}")
    if probe_steps is not None and method != "probe":
        raise ConfigError(f"`--probe-steps` only applies to `--method probe`. Received: method={method!r}, "
                          f"probe_steps={probe_steps!r}")
    if write and not config_path:
        raise ConfigError("`trainwell lr-find --write` needs `--config FILE`: the file to write the suggestion into.")
    if write and lr_field(recipe_module, cfg) is None and not hasattr(recipe_module, "lr_to_config"):
        raise ConfigError(
            f"Cannot write the suggestion: the recipe's config has none of the fields {', '.join(LR_FIELDS)} "
            "and the recipe defines no `LR_FIELD` or `lr_to_config`."
        )
    if write and not os.access(Path(config_path).parent, os.W_OK | os.X_OK):
        raise ConfigError(f"`--write` cannot rewrite {config_path!r}: its directory {str(Path(config_path).parent)!r} "
                          "is not writable (the file is replaced through a temporary file beside it).")


def _print_result(result) -> None:
    """The suggestion (or why there is none), with the other methods' values and the probes' losses."""
    others = ", ".join(f"{k}: {v:.3g}" for k, v in result.suggestions.items() if k != result.method)
    probed = ""
    if result.probes:
        probed = (f"; then {len(result.probes)} probe runs of {result.probe_steps} steps ({result.probe_schedule}): "
                  + ", ".join(f"{lr:.3g} -> {'diverged' if not math.isfinite(v) else f'{v:.4g}'}"
                              for lr, v in sorted(result.probes.items())))
    details = f"[{others}; range test {len(result.lrs)} steps, stopped: {result.stopped}{probed}]"
    if result.reliable:
        print(f"Suggested peak learning rate ({result.method}): {result.suggestion:.3g}   {details}")
    else:
        print(f"No reliable learning rate: {result.reason}.   {details}")


def _write_suggestion(cfg, config_path, updates: dict, value: float, method: str) -> int:
    """`--write`: each field of `updates` into the config file, a comment saying where it came from."""
    try:
        for k, v in updates.items():
            was = getattr(cfg, k, None)
            note = f"peak LR {value:.3g} from trainwell lr-find ({method})" + (f"; was {was}" if was is not None else "")
            write_config_value(config_path, k, v, comment=note)
    except OSError as e:
        print(f"trainwell: error: cannot write {config_path!r}: {os_error_reason(e)}; set the value with the "
              "--set above instead.", file=sys.stderr)
        return 1
    print(f"Wrote {', '.join(f'{k}: {v}' for k, v in updates.items())} into {config_path}")
    return 0


def _run_lr_find(recipe_module, cfg, args, strategy, method, probe_steps, lr_finder):
    """The range test (and probes) on the recipe's compiled model and training data."""
    runtime.set_precision(getattr(cfg, "precision", "auto"))
    runtime.seed_everything(int(getattr(cfg, "seed", 0)))
    with strategy.scope():
        if hasattr(recipe_module, "lr_find_setup"):
            model, train = recipe_module.lr_find_setup(cfg)
        else:
            data = recipe_module.build_data(cfg)
            train = _train_split(data)
            build = recipe_module.build_model
            required = [
                p for p in inspect.signature(build).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            model = build(cfg, data) if len(required) >= 2 else build(cfg)
            if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
                if not hasattr(recipe_module, "compile_model"):
                    raise ConfigError("the recipe's `build_model` returned an uncompiled model and it has no `compile_model(cfg, model)`.")
                recipe_module.compile_model(cfg, model)
    with runtime.fit_scope(strategy), warnings.catch_warnings():  # the reason is printed below, with the CLI's advice
        warnings.filterwarnings("ignore", message="No reliable learning rate")
        return lr_finder.lr_find(model, train, batch_size=getattr(cfg, "batch_size", None), method=method,
                                 probe_steps=probe_steps, probe_schedule=CLI_PROBE_SCHEDULE,
                                 verbose=getattr(args, "verbose", 1))


def lr_config_updates(recipe_module, cfg, peak_lr: float) -> dict[str, float]:
    """The config fields to set (name -> value) for a peak learning rate of `peak_lr`.

    The recipe's `lr_to_config(cfg, peak_lr)` where it has one (e.g. the ResNet
    recipe's `base_lr`, per `lr_base_batch` images), else `{field: peak_lr}` for its
    LR field (`LR_FIELD`, else the first of `LR_FIELDS` its config has), else `{}`.

    Args:
        recipe_module: The recipe module. Required.
        cfg: Its resolved `Config`. Required.
        peak_lr: The peak learning rate. Required.

    Example:
    >>> from trainwell.recipes import resnet_imagenet
    >>> lr_config_updates(resnet_imagenet, resnet_imagenet.Config(dataset="digits", batch_size=512), 0.2)
    {'base_lr': 0.1}
    """
    if hasattr(recipe_module, "lr_to_config"):
        return dict(recipe_module.lr_to_config(cfg, peak_lr))
    field = lr_field(recipe_module, cfg)
    return {field: peak_lr} if field else {}


def _lr_note(recipe_module, cfg, updates: dict, peak_lr: float) -> str:
    """What the values give, when the field set is not the peak LR itself (e.g. a base LR per 256 images)."""
    if updates == {lr_field(recipe_module, cfg): peak_lr}:
        return ""
    batch = getattr(cfg, "batch_size", None)
    return f"  (a peak LR of {peak_lr:.3g}" + (f" at batch_size={batch})" if batch else ")")


