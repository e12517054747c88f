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
import difflib
import json
import math
import os
import re
import stat
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from trainwell.io import atomic_write_text
from trainwell.runtime import MAX_SEED, PRECISION_SPECS, STRATEGY_SPECS, validate_strategy_spec
from trainwell.validation import check_url, invalid_argument, is_int, is_number, is_url


class ConfigError(ValueError):
    """A config value, key or file is invalid. The message is a single line.

    Example:
    >>> raise ConfigError("Unknown config key `epoch`.")  # doctest: +SKIP
    """


def config_error(key: str, value: Any, problem: str, hint: str = "") -> ConfigError:
    """The one-line `ConfigError` for a bad config value (the caller raises it).

    Args:
        key: The config field.
        value: What the config holds.
        problem: What is wrong, e.g. `"expected an integer >= 1"`.
        hint: A sentence to add (e.g. `did_you_mean(...)`), starting with a space. Defaults to `""`.

    Example:
    >>> str(config_error("epochs", 0, "expected an integer >= 1"))
    'Invalid value for `epochs`: expected an integer >= 1. Received: epochs=0'
    """
    return invalid_argument(key, problem, value, what="", hint=hint, error=ConfigError)


def raise_invalid(key: str, value: Any, expected: str, hint: str = "") -> typing.NoReturn:
    """Raises `config_error(key, value, "expected " + expected, hint)`: what a recipe's `validate` calls.

    Args:
        key: The config field.
        value: What the config holds.
        expected: What it should be, e.g. `"an integer >= 1"`.
        hint: A sentence to add, starting with a space. Defaults to `""`.

    Example:
    >>> raise_invalid("epochs", 0, "an integer >= 1")
    Traceback (most recent call last):
    ...
    trainwell.config.ConfigError: Invalid value for `epochs`: expected an integer >= 1. Received: epochs=0
    """
    raise config_error(key, value, f"expected {expected}", hint)


def close_matches(value: str, choices: typing.Iterable[str], n: int = 2) -> list[str]:
    """The (at most `n`) `choices` closest to `value` by difflib, exact case first, then ignoring case.

    Args:
        value: What the user wrote.
        choices: The valid names.
        n: Matches at most. Defaults to `2`.

    Example:
    >>> close_matches("rotten-tomatoes", ["rotten_tomatoes", "mnist5k"])
    ['rotten_tomatoes']
    """
    choices = list(dict.fromkeys(str(c) for c in choices))
    close = difflib.get_close_matches(str(value), choices, n=n, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = [lowered[c] for c in difflib.get_close_matches(str(value).lower(), list(lowered), n=n, cutoff=0.6)]
    return close


def did_you_mean(value: str, choices: typing.Iterable[str], n: int = 2) -> str:
    """`" Did you mean 'x'?"` for the `choices` closest to `value` (`close_matches`), or `""`.

    Args:
        value: What the user wrote.
        choices: The valid names (or whole suggestions).
        n: Suggestions at most. Defaults to `2`.

    Example:
    >>> did_you_mean("mnist", ["mnist5k", "digits"])
    " Did you mean 'mnist5k'?"
    """
    return suggest(close_matches(value, choices, n))


def suggest(options: typing.Iterable[str]) -> str:
    """`" Did you mean 'a' or 'b'?"` for `options`, or `""` when there are none.

    Args:
        options: The suggestions, as they should be quoted.

    Example:
    >>> suggest(["folder:/data"])
    " Did you mean 'folder:/data'?"
    """
    options = list(options)
    return f" Did you mean {' or '.join(repr(o) for o in options)}?" if options else ""


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


def _coerce_number(key: str, value: Any, tp: type, expected: str) -> int | float:
    """`coerce` for an `int` or `float` field: a bool is not a number, a float must be finite."""
    if isinstance(value, bool):
        raise_invalid(key, value, expected)
    if tp is int:
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
        raise_invalid(key, value, expected)
    number = None
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            raise_invalid(key, value, "a finite number")
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None:
        raise_invalid(key, value, expected)
    if not math.isfinite(number):  # nan, inf: no field of a recipe means them
        raise_invalid(key, value, "a finite number")
    return number


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
        if len(errors) == 1:  # Optional[X]: X's own message ("a finite number", ...) says more
            raise errors[0]
        raise_invalid(key, value, expected)
    if origin is Literal:
        for a in args:
            if value == a or (isinstance(value, str) and str(a) == value):
                return a
        raise_invalid(key, value, expected)
    if origin in (tuple, list):
        if from_string and isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v.strip()]
            except yaml.YAMLError:
                raise_invalid(key, value, expected)
        if not isinstance(value, (list, tuple)):
            raise_invalid(key, value, expected)
        item_tp = args[0] if args else Any
        try:
            items = [coerce(key, v, item_tp, from_string and isinstance(v, str)) for v in value]
        except ConfigError:
            raise_invalid(key, value, expected)
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if from_string and isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise_invalid(key, value, expected)
        if not isinstance(value, dict):
            raise_invalid(key, value, expected)
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise_invalid(key, value, expected)
    if tp in (int, float):
        return _coerce_number(key, value, tp, expected)
    if tp is str:
        if isinstance(value, str):
            return value
        raise_invalid(key, value, expected)
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
        strategy: `"auto"`, `"mirrored"`, `"multiworker"`, `"tpu"`, `"one_device"`, `"cpu:N"` or
            `"model_parallel:DxM"` (JAX: a data x model device mesh laid out by the backbone's keras-hub layout map).
        seed: Random seed.
        run_dir: Run directory; `None` makes a fresh one under `runs/`; an `s3://` or `gs://` URL
            writes the run to object storage (docs/checkpoint.md).

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
        if not self.dataset.strip():
            raise_invalid("dataset", self.dataset, "a non-empty dataset name")
        check_positive(self, "epochs")
        check_positive(self, "batch_size")
        check_choice(self, "precision", PRECISION_SPECS)
        try:
            validate_strategy_spec(self.strategy)
        except ValueError:
            raise_invalid("strategy", self.strategy, "one of " + ", ".join(repr(p) for p in STRATEGY_SPECS),
                  did_you_mean(self.strategy, [s for s in STRATEGY_SPECS if ":" not in s]))
        check_seed(self, "seed")
        check_run_dir(self.run_dir)

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
        return atomic_write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


def check_positive(cfg: Any, name: str, allow_zero: bool = False) -> None:
    """Raises `ConfigError` unless `cfg.<name>` is a finite number > 0 (>= 0 with `allow_zero`).

    Args:
        cfg: The config.
        name: The field.
        allow_zero: Accept 0. Defaults to `False`.

    Example:
    >>> check_positive(BaseConfig(), "epochs")
    """
    v = getattr(cfg, name)
    if v is None:
        return
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise_invalid(name, v, "a number >= 0" if allow_zero else "a number > 0")


def check_seed(cfg: Any, name: str = "seed") -> None:
    """Raises `ConfigError` unless `cfg.<name>` is an integer in [0, 2**32 - 1].

    `keras.utils.set_random_seed` seeds NumPy's legacy generator, which takes 32 bits.

    Args:
        cfg: The config.
        name: The seed field. Defaults to `"seed"`.

    Example:
    >>> check_seed(BaseConfig(seed=7))
    """
    v = getattr(cfg, name)
    if v is not None and not 0 <= v <= MAX_SEED:
        raise_invalid(name, v, f"an integer in [0, {MAX_SEED}] (2**32 - 1)")


def check_run_dir(run_dir: str | os.PathLike | None, name: str = "run_dir") -> None:
    """Raises `ConfigError` when `run_dir` cannot be a directory this process writes.

    It cannot when it, or a parent, is a file, or when the nearest part of it that
    exists is a directory this process may not write (permission denied, a
    read-only file system). Nothing is created; an existing directory is fine (that
    is how a run resumes). What only trying tells (e.g. `/proc`, which refuses new
    entries even to root) is reported when the directory is made
    (`trainwell.rundir.make_run_dir`), in the same one line.

    Args:
        run_dir: The directory, or `None` (a fresh one is named at run time).
        name: The field named in the message. Defaults to `"run_dir"`.

    Example:
    >>> check_run_dir("runs/new-run")
    """
    if is_url(run_dir):  # an object store: the URL is checked here, its bucket when the run starts (`setup_run`)
        check_url(run_dir, name, what="", error=ConfigError)
        return
    check_dir_path(run_dir, name, write=True)


def check_dir_path(path: str | os.PathLike | None, name: str, write: bool = False) -> None:
    """Raises `ConfigError` unless `path` is (or, with `write`, can become) a usable directory.

    - any part of it that exists is a file: "is a file; expected a directory";
    - a part cannot be looked at (permission denied): "cannot be read";
    - `write=False` (data to read): an existing `path` must be a directory this
      process may list and read; a missing one is left to the reader (its own
      message says what it looked for);
    - `write=True` (a directory to write): the nearest part that exists must be a
      directory this process may write into (not on a read-only file system).

    Nothing is created. Each message is one line naming the field, the path and why.

    Args:
        path: The directory, or `None` (nothing to check).
        name: The field (or option) named in the message.
        write: Whether the directory is written (made if missing). Defaults to `False`.

    Example:
    >>> check_dir_path("/", "data_dir")
    >>> check_dir_path("/etc/hostname/x", "data_dir")  # doctest: +SKIP
    Traceback (most recent call last):
    ...
    trainwell.config.ConfigError: Invalid value for `data_dir`: '/etc/hostname/x' is inside '/etc/hostname', which is a file; expected a directory. Received: data_dir='/etc/hostname/x'
    """
    if path is None:
        return
    if not str(path).strip():
        raise_invalid(name, path, "null or a directory path")
    if is_url(str(path)):
        raise config_error(name, str(path), "a URL; only `run_dir`, a search's `--directory` and "
                           "`Checkpoint(directory=...)` may be on an object store so far (docs/checkpoint.md)")
    given = Path(path).expanduser()

    def refuse(why: str) -> typing.NoReturn:
        raise config_error(name, str(path), f"{str(given)!r} {why}")

    for p in (given, *given.parents):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if not write and p == given:
                return  # a missing data directory: the reader says what it looked for
            continue
        except NotADirectoryError:
            continue  # a parent is a file: found further up
        except OSError as e:
            refuse(f"cannot be reached: {os_error_reason(e)}")
        if not stat.S_ISDIR(st.st_mode):
            refuse(("is a file" if p == given else f"is inside {str(p)!r}, which is a file") + "; expected a directory")
        if write:
            if not os.access(p, os.W_OK | os.X_OK):
                where = "" if p == given else f" (its nearest existing parent {str(p)!r})"
                refuse(f"cannot be written{where}: {_not_writable_reason(p)}")
        elif not os.access(p, os.R_OK | os.X_OK):
            refuse("cannot be read: permission denied")
        return


def os_error_reason(e: OSError) -> str:
    """An `OSError` in a few lowercase words for a one-line message: `"permission denied"`, ...

    Example:
    >>> os_error_reason(PermissionError(13, "Permission denied", "/x"))
    'permission denied'
    """
    return (e.strerror or str(e) or type(e).__name__).strip().lower()


def _not_writable_reason(path: Path) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        pass
    return "permission denied"


def check_range(cfg: Any, name: str, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> None:
    """Raises `ConfigError` unless `cfg.<name>` lies in the given interval."""
    v = getattr(cfg, name)
    if v is None:
        return
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        raise_invalid(name, v, f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


def check_choice(cfg: Any, name: str, choices: typing.Iterable[Any]) -> None:
    """Raises `ConfigError` unless `cfg.<name>` is one of `choices` (with "did you mean").

    Args:
        cfg: The config.
        name: The field.
        choices: The valid values.

    Example:
    >>> check_choice(BaseConfig(), "precision", ["auto", "float32"])
    """
    choices = tuple(choices)
    v = getattr(cfg, name)
    if v not in choices:
        hint = did_you_mean(v, [c for c in choices if isinstance(c, str)]) if isinstance(v, str) else ""
        raise_invalid(name, v, "one of " + ", ".join(repr(c) for c in choices), hint)


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
        raise_invalid("checkpoint_every", cfg.checkpoint_every, "'epoch' or a positive number of steps")


def _unknown_key_message(cls, key: str) -> str:
    """The one line for a key that is no field: "did you mean" the closest field.

    A key that names a property of the config (a value derived from fields, e.g. the
    ResNet recipe's `peak_lr` = `base_lr x batch_size / lr_base_batch`) is not
    settable: the line quotes the property's first docstring line and suggests the
    first field that line names.
    """
    names = cls.field_names()
    derived = getattr(cls, str(key), None) if str(key).isidentifier() and not str(key).startswith("_") else None
    if isinstance(derived, property):
        doc = ((derived.__doc__ or "").strip().splitlines() or [""])[0].rstrip(".")
        words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc)
        source = next((w for w in words if w in names), None)
        what = f" ({doc})" if doc else ""
        hint = f" Did you mean `{source}`?" if source else ""
        return (f"Config key `{key}` of {cls.__qualname__} is derived from other fields{what}, not set.{hint} "
                f"Expected one of: {', '.join(names)}.")
    close = difflib.get_close_matches(str(key), names, n=1)
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


def override_text(value: Any) -> str:
    """A config value as `--set key=VALUE` takes it (what `parse_overrides` reads back).

    4 significant digits for a float, `[a,b]` for a list, `null`, `true`/`false`.

    Args:
        value: The config value.

    Example:
    >>> override_text(0.123456), override_text([1, 2]), override_text(None), override_text("sgd")
    ('0.1235', '[1,2]', 'null', 'sgd')
    """
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(x) for x in value) + "]"
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


class _UniqueKeySafeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader (LibYAML's parser where installed: fast, and it stops at 1,000 levels
    of nesting) that refuses a key given twice in one mapping (YAML says keys are unique;
    PyYAML would silently keep the last one)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    first_line: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            seen = key in first_line
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
        if seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first given on line {first_line[key] + 1})", key_node.start_mark
            )
        first_line[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeySafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _yaml_error_line(e: yaml.YAMLError) -> str:
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_config_file(path: str | os.PathLike) -> dict:
    """Reads a YAML or JSON config file into a dict (safe loader only).

    The file must be UTF-8 text (a byte-order mark is allowed); a key given twice in one
    mapping is an error rather than PyYAML's silent last-one-wins. Every problem is a
    one-line `ConfigError` naming the file.

    Example:
    >>> read_config_file("missing.yaml")  # doctest: +SKIP
    Traceback (most recent call last):
    ConfigError: Config file not found: missing.yaml
    """
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"Config file not found: {str(p)!r}") from None
    except OSError as e:
        raise ConfigError(f"Cannot read config file {str(p)!r}: {os_error_reason(e)}.") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"Config file {str(p)!r} is a directory; expected a .yaml, .yml or .json file.")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"Config file {str(p)!r} is not a regular file; expected a .yaml, .yml or .json file.")
    suffix = p.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"Unsupported config file type {p.suffix!r}: expected .yaml, .yml or .json. Received: {str(p)!r}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"Cannot read config file {str(p)!r}: {os_error_reason(e)}.") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"Config file {str(p)!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8."
        ) from None
    try:
        if suffix == ".json":
            data = json.loads(text) if text.strip() else {}
        else:
            data = yaml.load(text, Loader=_UniqueKeySafeLoader) or {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"Cannot parse config file {str(p)!r}: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"Cannot parse config file {str(p)!r}: {_yaml_error_line(e)}") from None
    except RecursionError:
        raise ConfigError(f"Cannot parse config file {str(p)!r}: nested too deeply for a config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(p)!r} must hold a mapping of field names to values. Received: {type(data).__name__}")
    return data


def scaled_lr(base_lr: float, global_batch: int, base_batch: int = 256) -> float:
    """The linear scaling rule: `base_lr * global_batch / base_batch`.

    Goyal et al. (2017): when the minibatch is multiplied by k, multiply the
    learning rate by k (with warmup). ResNet-50 on ImageNet: 0.1 per 256 images.

    Args:
        base_lr: LR that works at `base_batch`. Required.
        global_batch: Global batch size (summed over replicas). Required.
        base_batch: Batch size `base_lr` is quoted for. Defaults to `256`.

    Returns:
        The scaled learning rate (float).

    Example:
    >>> scaled_lr(0.1, 8192)
    3.2
    """
    if not is_number(base_lr) or base_lr <= 0:
        raise invalid_argument("base_lr", "a float > 0", base_lr)
    if not is_int(global_batch) or global_batch < 1:
        raise invalid_argument("global_batch", "an integer >= 1", global_batch)
    if not is_int(base_batch) or base_batch < 1:
        raise invalid_argument("base_batch", "an integer >= 1", base_batch)
    return float(base_lr) * int(global_batch) / int(base_batch)
