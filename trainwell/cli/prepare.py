"""`trainwell prepare-images`: a source's training split as prepared JPEG TFRecord shards.

The work is `trainwell.data.prepare.prepare_images`; this module is the command's part:
its arguments, its output, and its errors as one line with exit status 2
(`trainwell.cli.main` prints a `ConfigError` or `DataError` that way).

Example:
>>> import argparse
>>> p = argparse.ArgumentParser(); add_prepare_parser(p.add_subparsers())
>>> p.parse_args(["prepare-images", "folder:photos", "out", "--max-side", "160"]).max_side
160
"""

from __future__ import annotations

import json

from trainwell.config import ConfigError

__all__ = ["add_prepare_parser", "cmd_prepare_images"]


def cmd_prepare_images(args) -> int:
    """Runs `prepare_images` with the command's arguments; prints a JSON summary. Returns 0.

    Example:
    >>> import argparse
    >>> cmd_prepare_images(argparse.Namespace(src="", dst="out", max_side=256, data_dir=None, quality=90,
    ...     images_per_shard=1024, workers=None, num_classes=None, quiet=True))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    trainwell.config.ConfigError: Invalid value for argument `src`. ... Received: src=''
    """
    # lazy: TensorFlow loads when the command runs, not when the parser is built
    from trainwell.data.prepare import prepare_images

    try:
        result = prepare_images(args.src, args.dst, max_side=args.max_side, data_dir=args.data_dir,
                                quality=args.quality, images_per_shard=args.images_per_shard, workers=args.workers,
                                num_classes=args.num_classes, verbose=0 if args.quiet else 1)
    except ValueError as e:  # an argument's "Received:" line: a usage error, exit 2
        raise ConfigError(str(e)) from None
    print(json.dumps({"directory": result.directory, "images": result.count, "skipped": result.skipped,
                      "shards": result.shards, "reused_shards": result.reused,
                      "seconds": round(result.seconds, 1), "dataset": f"tfrecord:{result.directory}"}))
    return 0


def add_prepare_parser(sub) -> None:
    """Adds the `prepare-images` command to `sub` (an `add_subparsers()` result).

    Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_prepare_parser(p.add_subparsers())
    >>> p.parse_args(["prepare-images", "tfds:imagenette", "out"]).max_side
    256
    """
    pi = sub.add_parser("prepare-images", help="write a source's training split once, resized, as JPEG TFRecords")
    pi.add_argument("src", metavar="SRC", help="folder:PATH, tfds:NAME, tfrecord:GLOB, mnist5k, digits, or a directory")
    pi.add_argument("dst", metavar="DST", help="output folder (new, empty, or an interrupted one to resume)")
    pi.add_argument("--max-side", type=int, default=256, help="largest shorter side in px (default 256)")
    pi.add_argument("--data-dir", help="TFDS data_dir, and base of relative paths")
    pi.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images (default 90)")
    pi.add_argument("--images-per-shard", type=int, default=1024, help="records per shard (default 1024)")
    pi.add_argument("--workers", type=int, help="decode/resize threads (default: the cores this process may use)")
    pi.add_argument("--num-classes", type=int, help="classes of a TFRecord source (default 1000)")
    pi.add_argument("--quiet", action="store_true", help="no progress bar")
    pi.set_defaults(func=cmd_prepare_images)
