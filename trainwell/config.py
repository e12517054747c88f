"""Typed, validated recipe configs: one dataclass per recipe (TF Model Garden style).

A recipe's hyperparameters live in one dataclass whose defaults are the published
recipe, each with its source in a comment. This module adds what `dataclasses`
lacks: loading from YAML/JSON, `--set key=value` overrides coerced from the field
types, validation with one-line errors, and a round trip to the run directory.

YAML is read with `yaml.safe_load`; nothing from a config, run directory or
checkpoint is ever unpickled or executed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config value, key or file is invalid. The message is a single line.

    Example:
    >>> raise ConfigError("Unknown config key `epoch`.")  # doctest: +SKIP
    """


def _fail(key: str, value: Any, expected: str) -> None:
    raise ConfigError(f"Invalid value for `{key}`: expected {expected}. Received: {key}={value!r}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return inner + (" or null" if len(args) < len(typing.get_args(tp)) else "")
    if origin in (tuple, list):
        args = typing.get_args(tp)
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def coerce(key: str, value: Any, tp: Any, from_string: bool = False) -> Any:
    """Coerces `value` to the annotated type `tp`, or raises `ConfigError`.

    Strings from `--set` are parsed by type: numbers, `true/false`, `null`, and
    YAML flow lists (`[30, 60, 80]`) for list and tuple fields.

    Args:
        key: Field name (for the error message).
        value: The value to coerce.
        tp: The field's type annotation.
        from_string: Whether `value` came from the command line. Defaults to `False`.

    Returns:
        The coerced value.

    Example:
    >>> coerce("epochs", "5", int, from_string=True)
    5
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    expected = _type_name(tp)
    if tp is Any:
        return yaml.safe_load(value) if from_string and isinstance(value, str) else value
    if origin in (Union, types.UnionType):
        if type(None) in args and (value is None or (from_string and str(value).lower() in ("none", "null", "~", ""))):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(key, value, a, from_string)
            except ConfigError as e:
                errors.append(e)
        _fail(key, value, expected)
    if origin is Literal:
        for a in args:
            if value == a or (isinstance(value, str) and str(a) == value):
                return a
        _fail(key, value, expected)
    if origin in (tuple, list):
        if from_string and isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v.strip()]
            except yaml.YAMLError:
                _fail(key, value, expected)
        if not isinstance(value, (list, tuple)):
            _fail(key, value, expected)
        item_tp = args[0] if args else Any
        try:
            items = [coerce(key, v, item_tp, from_string and isinstance(v, str)) for v in value]
        except ConfigError:
            _fail(key, value, expected)
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if from_string and isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                _fail(key, value, expected)
        if not isinstance(value, dict):
            _fail(key, value, expected)
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        _fail(key, value, expected)
    if tp is int:
        if isinstance(value, bool):
            _fail(key, value, expected)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                    if f.is_integer():
                        return int(f)
                except ValueError:
                    pass
        _fail(key, value, expected)
    if tp is float:
        if isinstance(value, bool):
            _fail(key, value, expected)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        _fail(key, value, expected)
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(key, value, expected)
    return value


@dataclasses.dataclass
class BaseConfig:
    """Fields every recipe config has. Subclass it with `@dataclasses.dataclass`.

    Subclasses add fields (with the source of each default in a comment) and
    override `validate()` (calling `super().validate()`) for range checks. Values
    are type-checked and coerced at construction, so a bad value fails at once
    with a one-line `ConfigError`.

    Args:
        dataset: Dataset name (`"mnist5k"`, `"tfds:imagenet2012"`, ...).
        epochs: Number of training epochs.
        batch_size: Global batch size (summed over replicas).
        precision: `"auto"`, `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`.
        strategy: `"auto"`, `"mirrored"`, `"multiworker"`, `"tpu"`, `"one_device"` or `"cpu:N"`.
        seed: Random seed.
        run_dir: Run directory; `None` makes a fresh one under `runs/`.

    Example:
    >>> @dataclasses.dataclass
    ... class MyConfig(BaseConfig):
    ...     lr: float = 0.1
    >>> MyConfig.load(overrides=["lr=0.5", "epochs=3"]).lr
    0.5
    """

    dataset: str = "mnist5k"
    epochs: int = 1
    batch_size: int = 32
    precision: str = "auto"
    strategy: str = "auto"
    seed: int = 0
    run_dir: Union[str, None] = None

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f.name, getattr(self, f.name), hints[f.name]))
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Range checks; raises `ConfigError` with a one-line message."""
        from trainwell.runtime import PRECISION_SPECS, STRATEGY_SPECS, validate_strategy_spec

        if not self.dataset.strip():
            _fail("dataset", self.dataset, "a non-empty dataset name")
        check_positive(self, "epochs")
        check_positive(self, "batch_size")
        if self.precision not in PRECISION_SPECS:
            _fail("precision", self.precision, "one of " + ", ".join(repr(p) for p in PRECISION_SPECS))
        try:
            validate_strategy_spec(self.strategy)
        except ValueError:
            _fail("strategy", self.strategy, "one of " + ", ".join(repr(p) for p in STRATEGY_SPECS))
        if self.seed < 0:
            _fail("seed", self.seed, "an integer >= 0")

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict:
        """Plain dict of the fields (tuples become lists), safe for YAML/JSON."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict, from_string: bool = False):
        """Builds a config from a mapping; unknown keys raise `ConfigError`."""
        if not isinstance(values, dict):
            raise ConfigError(f"A config must be a mapping of field names to values. Received: {type(values).__name__}")
        known = set(cls.field_names())
        for k in values:
            if k not in known:
                raise ConfigError(_unknown_key_message(cls, k))
        hints = typing.get_type_hints(cls)
        kwargs = {k: coerce(k, v, hints[k], from_string) for k, v in values.items()}
        return cls(**kwargs)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        overrides: list[str] | dict | None = None,
        base: dict | None = None,
    ):
        """Loads a config: defaults, then `base`, then a YAML/JSON file, then overrides.

        Args:
            path: A `.yaml`, `.yml` or `.json` file of field values. Defaults to `None`.
            overrides: `["key=value", ...]` strings (as from `--set`) or a dict.
                Defaults to `None`.
            base: Field values to start from (e.g. a saved run's config).
                Defaults to `None`.

        Returns:
            The validated config.

        Example:
        >>> BaseConfig.load(overrides=["epochs=2"]).epochs
        2
        """
        values: dict = dict(base or {})
        if path is not None:
            values.update(read_config_file(path))
        str_values: dict = {}
        if isinstance(overrides, dict):
            values.update(overrides)
        elif overrides:
            str_values = parse_overrides(overrides)
        known = set(cls.field_names())
        for k in list(values) + list(str_values):
            if k not in known:
                raise ConfigError(_unknown_key_message(cls, k))
        hints = typing.get_type_hints(cls)
        merged = {k: coerce(k, v, hints[k]) for k, v in values.items()}
        merged.update({k: coerce(k, v, hints[k], from_string=True) for k, v in str_values.items()})
        return cls(**merged)

    def replace(self, **changes):
        """A copy with `changes` applied and validated."""
        known = set(self.field_names())
        for k in changes:
            if k not in known:
                raise ConfigError(_unknown_key_message(type(self), k))
        return dataclasses.replace(self, **changes)

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the config as YAML (atomically)."""
        from trainwell.io import atomic_write_text

        return atomic_write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


def check_positive(cfg: Any, name: str, allow_zero: bool = False) -> None:
    """Raises `ConfigError` unless `cfg.<name>` is > 0 (>= 0 with `allow_zero`)."""
    v = getattr(cfg, name)
    if v is None:
        return
    if v < 0 or (v == 0 and not allow_zero):
        _fail(name, v, "a number >= 0" if allow_zero else "a number > 0")


def check_range(cfg: Any, name: str, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> None:
    """Raises `ConfigError` unless `cfg.<name>` lies in the given interval."""
    v = getattr(cfg, name)
    if v is None:
        return
    ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        _fail(name, v, f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


def check_choice(cfg: Any, name: str, choices: typing.Iterable[Any]) -> None:
    """Raises `ConfigError` unless `cfg.<name>` is one of `choices`."""
    choices = tuple(choices)
    v = getattr(cfg, name)
    if v not in choices:
        _fail(name, v, "one of " + ", ".join(repr(c) for c in choices))


def check_reliability_fields(cfg: Any) -> None:
    """Checks the run fields every recipe `Config` shares (checkpoints, rollback, early stop).

    `steps_per_execution`, `keep_last`, `snapshot_every` >= 1, `early_stopping_patience`
    None or >= 1, and `checkpoint_every` "epoch" or a positive number of steps.

    Example:
    >>> from trainwell.recipes.resnet_imagenet import Config
    >>> check_reliability_fields(Config())
    """
    for name in ("steps_per_execution", "keep_last", "snapshot_every", "early_stopping_patience"):
        check_positive(cfg, name)
    every = str(cfg.checkpoint_every)
    if every != "epoch" and not (every.isdigit() and int(every) > 0):
        _fail("checkpoint_every", cfg.checkpoint_every, "'epoch' or a positive number of steps")


def _unknown_key_message(cls, key: str) -> str:
    import difflib

    names = cls.field_names()
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return f"Unknown config key `{key}` for {cls.__qualname__}.{hint} Expected one of: {', '.join(names)}."


def parse_overrides(items: list[str]) -> dict[str, str]:
    """Parses `["key=value", ...]` into a dict; a malformed item raises `ConfigError`.

    Example:
    >>> parse_overrides(["epochs=3", "lr=0.1"])
    {'epochs': '3', 'lr': '0.1'}
    """
    out = {}
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"Invalid override: expected key=value. Received: {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def read_config_file(path: str | os.PathLike) -> dict:
    """Reads a YAML or JSON config file into a dict (safe loader only).

    Example:
    >>> read_config_file("missing.yaml")  # doctest: +SKIP
    Traceback (most recent call last):
    ConfigError: Config file not found: missing.yaml
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Config file not found: {str(p)!r}")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text) if text.strip() else {}
        elif p.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"Unsupported config file type {p.suffix!r}: expected .yaml, .yml or .json. Received: {str(p)!r}")
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"Cannot parse config file {str(p)!r}: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(p)!r} must hold a mapping of field names to values. Received: {type(data).__name__}")
    return data
