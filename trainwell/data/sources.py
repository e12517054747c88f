"""Data sources and presets checked when a config is built, and the data error class.

A recipe's `Config.validate()` calls `check_image_source`, `check_text_source` and
`check_preset`, so a typo in a name, a missing path or a file that cannot be trained on
fails with one line when the config is built (`Config(...)`, `trainwell train
--dry-run`), before a run directory exists. `check_data_ready` adds what cannot be
asked of every config (a TFDS dataset must be prepared: the published ImageNet
default has to construct on a laptop too); the command line calls it before it runs
anything. Names get a "did you mean" (difflib) over the valid ones.

What is checked, per source:

| source | when the config is built | `check_data_ready` |
|---|---|---|
| `mnist5k`, `digits`, `rotten_tomatoes`, `minilm` | the carrying package is installed | |
| `folder:PATH` | exists; at least 2 class subfolders with images; not every image corrupt (up to 256 files looked at: signature and end marker) | |
| `tfrecord:GLOB` | matches files (local paths) | |
| `csv:PATH`, `jsonl:PATH` | parsed in full (cached for the run): UTF-8, fields, labels, at least 2 classes | |
| `tfds:NAME` | a registered TFDS name | prepared in `data_dir` |
| a preset | `minilm`, a preset directory (with `config.json`), a keras-hub preset name or a `scheme://` handle | |

`DataError` (a `ValueError`) is what the data loaders raise for data that cannot be
used: missing (`DataNotFoundError`, also a `FileNotFoundError`), empty, unreadable,
not UTF-8, a single class. Its message is one line naming the file or field; the
`trainwell` command prints it and exits with status 2.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from pathlib import Path
from typing import Iterable

from trainwell.config import ConfigError, close_matches, config_error, did_you_mean, suggest
from trainwell.data import text
from trainwell.data.base import DataError, DataNotFoundError, resolve_path
from trainwell.data.embedded import embedded_path
from trainwell.validation import invalid_argument


EMBEDDED_IMAGE_DATASETS = ("mnist5k", "digits")
EMBEDDED_TEXT_DATASETS = ("rotten_tomatoes",)
IMAGE_SOURCE_FORMS = ("mnist5k", "digits", "synthetic", "tfds:NAME", "folder:PATH", "tfrecord:GLOB")
TEXT_SOURCE_FORMS = ("rotten_tomatoes", "csv:PATH", "jsonl:PATH", "tfds:NAME")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
#: Training augmentations of the image pipelines (`trainwell.data.images`).
AUGMENTATIONS = ("auto", "inception", "pad_crop_flip", "pad_crop", "none")
#: Image files whose signature `check_image_folder` reads at most.
MAX_IMAGES_CHECKED = 256


def _expected(forms: Iterable[str]) -> str:
    forms = [repr(f) for f in forms]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


def _path_hint(path: Path) -> str:
    """" Did you mean '/data/imagenet'?" for a sibling whose name is close to a missing path's."""
    parent = path.parent
    try:
        siblings = [e.name for e in os.scandir(parent)] if parent.is_dir() else []
    except OSError:
        return ""
    return suggest(str(parent / name) for name in close_matches(path.name, siblings, n=1))


@contextlib.contextmanager
def _as_config_error(field: str, value: str):
    """Data problems found while a config is checked become `ConfigError`s naming the field."""
    try:
        yield
    except DataError as e:
        raise invalid_argument(field, str(e).rstrip("."), value, what="", error=ConfigError) from None


def _kind(source: str) -> tuple[str, str]:
    kind, sep, rest = source.strip().partition(":")
    return (kind.strip().lower(), rest.strip()) if sep else ("", source.strip())


def _source_hint(value: str, forms: Iterable[str], kinds: Iterable[str], data_dir: str | None) -> str:
    """"Did you mean" for an unknown source: a close name, a close kind, `folder:`/`csv:` for a path."""
    kind, rest = _kind(value)
    if kind:  # a misspelt kind: "foldr:/x"
        return suggest(f"{k}:{rest}" for k in close_matches(kind, kinds, n=1))
    options = close_matches(value, [f for f in forms if ":" not in f])
    path = Path(resolve_path(value, data_dir))
    if path.is_dir() and "folder" in kinds:
        options.append(f"folder:{value}")
    elif path.is_file() and path.suffix.lower().lstrip(".") in kinds:
        options.append(f"{path.suffix.lower().lstrip('.')}:{value}")
    elif "tfds" in kinds and _tfds_registered(value):
        options.append(f"tfds:{value}")
    return suggest(options)


# --------------------------------------------------------------------------- image sources
def check_image_source(source: str, data_dir: str | None = None, field: str = "dataset") -> None:
    """Checks an image source name or path; raises a one-line `ConfigError` naming `field`.

    Args:
        source: `"mnist5k"`, `"digits"`, `"synthetic"`, `"tfds:NAME"`, `"folder:PATH"` or
            `"tfrecord:GLOB"` (see `trainwell.data.images.build_image_datasets`).
        data_dir: Base of relative paths and the TFDS data directory. Defaults to `None`.
        field: The config field named in the message. Defaults to `"dataset"`.

    Example:
    >>> check_image_source("digits")
    >>> check_image_source("mnist")  # doctest: +SKIP
    Traceback (most recent call last):
    ConfigError: Invalid value for `dataset`: expected 'mnist5k', ... Did you mean 'mnist5k' or 'tfds:mnist'? Received: dataset='mnist'
    """
    if not isinstance(source, str) or not source.strip():
        raise config_error(field, source, f"expected {_expected(IMAGE_SOURCE_FORMS)}")
    kind, rest = _kind(source)
    if not kind and rest in EMBEDDED_IMAGE_DATASETS:

        with _as_config_error(field, source):
            embedded_path(rest)  # MissingDataError (with the install command) when not installed
        return
    if kind == "synthetic" or (not kind and rest == "synthetic"):
        return
    if kind == "embedded" and rest in EMBEDDED_IMAGE_DATASETS:
        return check_image_source(rest, data_dir, field)
    if kind in ("folder", "tfrecord", "tfds") and rest:
        check_source_url(source, field)
        if kind == "folder":
            with _as_config_error(field, source):
                check_image_folder(Path(resolve_path(rest, data_dir)))
        elif kind == "tfrecord":
            _check_tfrecord_glob(rest, data_dir, field, source)
        else:
            check_tfds_name(rest, data_dir, field, source)
        return
    hint = _source_hint(source, IMAGE_SOURCE_FORMS, ("tfds", "folder", "tfrecord", "synthetic"), data_dir)
    if kind == "embedded":
        hint = did_you_mean(rest, EMBEDDED_IMAGE_DATASETS)
    raise config_error(field, source, f"expected {_expected(IMAGE_SOURCE_FORMS)}", hint)


def check_source_url(source: str, field: str = "dataset") -> None:
    """A `folder:` or `tfrecord:` source on a URL: one-line `ConfigError` where it cannot be read.

    A class folder is listed with `os.walk` (local or mounted file systems only);
    TFRecord shards are read by TensorFlow's file systems (`gs://` is built in,
    `s3://` needs a plugin). Other sources and local paths pass.

    Example:
    >>> check_source_url("tfrecord:/data/train-*")
    """
    kind, rest = _kind(source)
    if "://" not in rest or kind not in ("folder", "tfrecord"):
        return
    if kind == "folder":
        raise config_error(field, source, "expected a local folder: a class folder is not read from an object "
                                          "store (copy it to a local disk, or mount it)")
    import tensorflow as tf  # lazy: only a URL asks TensorFlow which file systems it has

    scheme = rest.split("://", 1)[0].lower()
    schemes = [s for s in tf.io.gfile.get_registered_schemes() if s]
    if scheme not in schemes:
        raise config_error(field, source, f"{scheme}:// is not one of TensorFlow's file systems "
                                          f"({', '.join(schemes)}): copy the shards to a local disk or gs://")


def _check_tfrecord_glob(pattern: str, data_dir: str | None, field: str, source: str) -> None:
    if "://" in pattern:  # `check_source_url` took the scheme; the files are checked when read
        return
    full = Path(resolve_path(pattern, data_dir))
    if full.is_dir():
        full = full / "*"
    if not [f for f in glob.glob(str(full)) if os.path.isfile(f)]:
        where = full.parent
        if not where.is_dir():
            raise config_error(field, source, f"no directory {str(where)!r}", _path_hint(where))
        raise config_error(field, source, f"no TFRecord files match {str(full)!r}")


def list_images(class_dir: str | os.PathLike, limit: int | None = None) -> tuple[list[str], bool]:
    """Image paths under `class_dir`, and whether that was all of them.

    Without `limit`, every image, in sorted order (the pipelines' listing). With
    `limit`, the first `limit` found in directory order, reading no more of the
    directories than that needs (a config check on a folder of a million images
    stays quick).

    Args:
        class_dir: The folder, walked with symbolic links followed.
        limit: Paths at most. Defaults to `None` (all, sorted).

    Example:
    >>> list_images("/nonexistent")
    ([], True)
    """
    out: list[str] = []
    if limit is None:
        for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
            dirnames.sort()
            out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(IMAGE_EXTENSIONS))
        return out, True
    pending = [os.fspath(class_dir)]
    while pending:
        try:
            entries = os.scandir(pending.pop())
        except OSError:
            continue
        with entries:
            for e in entries:
                if e.name.lower().endswith(IMAGE_EXTENSIONS) and not e.is_dir():
                    if len(out) >= limit:
                        return out, False
                    out.append(e.path)
                elif e.is_dir():
                    pending.append(e.path)
    return out, True


def image_problem(path: str | os.PathLike) -> str | None:
    """Why the file at `path` is not a readable image, or `None` when it looks like one.

    The same structural check the image pipelines run in-graph before decoding (a known
    signature; for JPEG and PNG the end marker in the last KiB), on the first and last
    bytes of the file only.

    Args:
        path: The file.

    Example:
    >>> image_problem("/nonexistent.jpg")
    'unreadable (FileNotFoundError)'
    """
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 1024))
            tail = f.read()
    except OSError as e:
        return f"unreadable ({type(e).__name__})"
    if not head:
        return "empty file"
    if head.startswith(b"\xff\xd8\xff"):
        return None if b"\xff\xd9" in tail else "truncated JPEG (no end marker)"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return None if b"IEND" in tail else "truncated PNG (no IEND chunk)"
    if head.startswith((b"GIF8", b"BM")) or (head.startswith(b"RIFF") and head[8:12] == b"WEBP"):
        return None
    return "not an image (unknown signature)"


def check_image_folder(root: str | os.PathLike) -> None:
    """Checks an image folder: it exists, has 2+ classes with images, and not every image is corrupt.

    The layout is `ROOT/<class>/...` or `ROOT/train/<class>/...` (with optional `val` /
    `validation` / `test`). The first images of each class (at most
    `MAX_IMAGES_CHECKED` in all) are checked with `image_problem`; when none of them is
    readable the folder is refused with the counts: a folder where every image is
    corrupt would train on nothing. Corrupt images among readable ones are skipped and
    counted by the pipeline, as documented in `trainwell.data.images`.

    Args:
        root: The folder.

    Raises:
        DataNotFoundError: the folder does not exist.
        DataError: not a directory, no classes with images, one class, every image
            checked corrupt. One line naming the folder.

    Example:
    >>> check_image_folder("/nonexistent")  # doctest: +SKIP
    Traceback (most recent call last):
    DataNotFoundError: Image folder '/nonexistent' not found.
    """
    root = Path(root)
    if not root.exists():
        raise DataNotFoundError(f"Image folder {str(root)!r} not found.{_path_hint(root)}")
    if not root.is_dir():
        raise DataError(f"Image folder {str(root)!r} is not a directory.")
    try:
        subdirs = {p.name.lower(): p for p in root.iterdir() if p.is_dir()}
        train = subdirs.get("train", root)
        classes = sorted(p for p in train.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as e:
        raise DataError(f"Cannot list the image folder {str(root)!r}: {e.strerror or type(e).__name__}.") from None
    per_class = max(1, MAX_IMAGES_CHECKED // max(1, len(classes)))
    sampled: dict[str, list[str]] = {}
    complete = True
    for c in classes:
        files, whole = list_images(c, per_class)
        if files:
            sampled[c.name] = files
            complete = complete and whole
    layout = ("Expected one subfolder of images per class, e.g. ROOT/cat/001.jpg and ROOT/dog/002.jpg, "
              "optionally under ROOT/train, ROOT/val, ROOT/test.")
    if not sampled:
        raise DataError(f"Empty image folder: {str(train)!r} has no class subfolders with "
                        f"{'/'.join(e[1:] for e in IMAGE_EXTENSIONS)} images. {layout}")
    if len(sampled) < 2:
        (name,) = sampled
        n = len(list_images(train / name, None)[0])
        raise DataError(f"The image folder {str(train)!r} has images of only 1 class ({name!r}, {n} images): "
                        f"a classifier needs at least 2. {layout}")
    problems = [(p, image_problem(p)) for files in sampled.values() for p in files]
    if all(problem is not None for _, problem in problems):
        first, why = problems[0]
        scope = (f"all {len(problems)} images" if complete
                 else f"all {len(problems)} images checked (the first of each of its {len(sampled)} classes)")
        raise DataError(f"Nothing to train on: {scope} of the image folder {str(train)!r} are corrupt or "
                        f"unreadable, e.g. {first!r}: {why}.")


# --------------------------------------------------------------------------- TFDS
def _tfds_registered(name: str) -> bool:
    try:
        # lazy: TFDS loads on first use, not with this module
        import tensorflow_datasets as tfds

        return name.split(":")[0].split("/")[0] in set(tfds.list_builders(with_community_datasets=False))
    except Exception:  # tfds missing or broken: no suggestion
        return False


def check_tfds_name(name: str, data_dir: str | None = None, field: str = "dataset", source: str | None = None) -> None:
    """Checks that `name` (`"cifar10"`, `"glue/sst2"`, `"mnist:3.0.1"`) is a registered TFDS dataset.

    Nothing is read or downloaded; whether it is prepared is `check_data_ready`'s.

    Args:
        name: The name after `tfds:`.
        data_dir: The TFDS data directory. Defaults to `None` (TFDS's default).
        field: The config field named in the message. Defaults to `"dataset"`.
        source: The source as written, for the message. Defaults to `None` (`tfds:NAME`).

    Example:
    >>> check_tfds_name("mnist")  # doctest: +SKIP
    """
    source = source or f"tfds:{name}"
    try:
        # lazy: TFDS loads on first use, not with this module
        import tensorflow_datasets as tfds
    except ImportError:
        raise config_error(field, source, "tensorflow-datasets, which is not installed (pip install tensorflow-datasets)")
    try:
        tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        base = name.split(":")[0].split("/")[0]
        names = tfds.list_builders(with_community_datasets=False)
        raise config_error(field, source, f"{base!r} is not a TFDS dataset",
              suggest(f"tfds:{n}" for n in close_matches(base, names)))
    except Exception as e:  # e.g. an unknown config ("glue/sst3") or version
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise config_error(field, source, f"not a usable TFDS dataset: {first.rstrip('.')}")


def check_data_ready(source: str, data_dir: str | None = None) -> None:
    """Raises `DataNotFoundError` when a `tfds:` source is not prepared in `data_dir`.

    What `Config.validate()` leaves out because every config must construct (the
    published ImageNet default included); `trainwell train` and `--dry-run` call it
    before anything runs. Other sources need nothing more.

    Args:
        source: The config's `dataset`.
        data_dir: The TFDS data directory. Defaults to `None` (TFDS's default).

    Example:
    >>> check_data_ready("mnist5k")
    """
    kind, rest = _kind(source) if isinstance(source, str) else ("", "")
    if kind != "tfds" or not rest:
        return
    # lazy: TFDS loads on first use, not with this module
    import tensorflow_datasets as tfds

    builder = tfds.builder(rest, data_dir=data_dir)
    if not builder.is_prepared():
        raise DataNotFoundError(
            f"TFDS dataset {rest!r} is not prepared in data_dir {str(builder.data_dir)!r}: prepare it first "
            f"(`tfds build {rest} --data_dir DIR`; ImageNet needs a manual download) or set `data_dir`."
        )


# --------------------------------------------------------------------------- text sources
def check_text_source(
    source: str,
    data_dir: str | None = None,
    text_field: str | None = None,
    label_field: str = "label",
    field: str = "dataset",
) -> None:
    """Checks a text source; a CSV/JSONL file is parsed in full (`trainwell.data.text`).

    The parse is cached, so the run that follows reads the file once. Any problem with
    the file (missing, not UTF-8, a bad line, a missing field, non-scalar labels, a
    single class) is a one-line `DataError` naming the file and line.

    Args:
        source: `"rotten_tomatoes"`, `"csv:PATH"`, `"jsonl:PATH"`, `"tfds:NAME"` or
            `"memory"` (in-memory data given to `train(data=...)`).
        data_dir: Base of relative paths and the TFDS data directory. Defaults to `None`.
        text_field: The text column. Defaults to `None` (the first of the usual names).
        label_field: The label column. Defaults to `"label"`.
        field: The config field named in the message. Defaults to `"dataset"`.

    Example:
    >>> check_text_source("rotten_tomatoes")
    """
    if not isinstance(source, str) or not source.strip():
        raise config_error(field, source, f"expected {_expected(TEXT_SOURCE_FORMS)}")
    kind, rest = _kind(source)
    if not kind and rest in EMBEDDED_TEXT_DATASETS:

        with _as_config_error(field, source):
            embedded_path(rest)
        return
    if not kind and rest == "memory":
        return
    if kind in ("csv", "jsonl") and rest:

        path = Path(resolve_path(rest, data_dir))
        if not path.exists():
            raise config_error(field, source, f"no file or directory {str(path)!r}", _path_hint(path))
        with _as_config_error(field, source):
            text.read_file_source(kind, rest, data_dir, text_field, label_field, check_labels=True)
        return
    if kind == "tfds" and rest:
        check_tfds_name(rest, data_dir, field, source)
        return
    hint = _source_hint(source, TEXT_SOURCE_FORMS, ("csv", "jsonl", "tfds"), data_dir)
    raise config_error(field, source, f"expected {_expected(TEXT_SOURCE_FORMS)}", hint)


# --------------------------------------------------------------------------- presets
def check_preset(preset: str, field: str = "preset", task: str = "TextClassifier") -> None:
    """Checks a keras-hub preset: `"minilm"`, a preset directory, a preset name or a handle.

    A directory must hold the preset's `config.json`; a name must be one of the
    keras-hub `task`'s presets ("did you mean" otherwise); a handle with a scheme
    (`kaggle://`, `hf://`) is left to keras-hub. Nothing is downloaded.

    Args:
        preset: The config's `preset`.
        field: The config field named in the message. Defaults to `"preset"`.
        task: The keras-hub task class whose presets a name must be among:
            `"TextClassifier"` (which also takes the embedded `"minilm"`) or
            `"CausalLM"`. Defaults to `"TextClassifier"`.

    Example:
    >>> check_preset("minilm")
    """
    kind = {"TextClassifier": "text classifier", "CausalLM": "causal LM"}[task]
    embedded = ("minilm",) if task == "TextClassifier" else ()
    expected = f"{''.join(repr(e) + ', ' for e in embedded)}a preset directory, a keras-hub {kind} preset name or a " \
               "kaggle:// / hf:// handle"
    if not isinstance(preset, str) or not preset.strip():
        raise config_error(field, preset, f"expected {expected}")
    if preset in embedded:

        with _as_config_error(field, preset):
            embedded_path(preset)
        return
    if "://" in preset:
        return
    path = Path(preset).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise config_error(field, preset, f"{str(path)!r} is not a preset directory (no config.json)")
        return
    if preset.startswith((".", "/", "~")) or os.sep in preset:
        raise config_error(field, preset, f"preset directory {str(path)!r} not found", _path_hint(path))
    # lazy: keras-hub loads on first use, not with this module
    import keras_hub

    names = sorted(getattr(keras_hub.models, task).presets)
    if preset not in names:
        try:  # a preset directory here, named without "./": suggested too
            local = [p.name for p in Path.cwd().iterdir() if p.is_dir() and (p / "config.json").is_file()]
        except OSError:
            local = []
        raise config_error(field, preset, f"expected {expected}; {preset!r} is not a keras-hub {kind} preset "
                                          "(nor a directory here)", did_you_mean(preset, [*embedded, *names, *local]))


def preset_max_sequence_length(preset: str) -> int | None:
    """The `max_sequence_length` of a local preset directory's backbone (`None`: unknown, or not a directory).

    Example:
    >>> preset_max_sequence_length("gpt2_base_en") is None
    True
    """
    path = Path(str(preset)).expanduser() / "config.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("config", {}).get("max_sequence_length")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


__all__ = [
    "AUGMENTATIONS",
    "DataError",
    "DataNotFoundError",
    "check_data_ready",
    "check_image_folder",
    "check_image_source",
    "check_preset",
    "preset_max_sequence_length",
    "check_source_url",
    "check_text_source",
    "check_tfds_name",
    "image_problem",
    "list_images",
    "resolve_path",
]
