"""The one set of argument checks every trainwell module uses (floor 0, imports nothing of trainwell).

Python's `numbers` ABCs already say what an integer or a real is (numpy registers
its scalars with them); what they lack is "but not a bool" and "and finite", and
Keras's one-line error idiom for a bad constructor argument. Config files have
their own error type and wording: `trainwell.config.config_error`.

Example:
>>> is_int(3), is_int(True), is_number(float("nan"))
(True, False, False)
>>> raise invalid_argument("lr_factor", "a float in (0, 1)", 2.0)
Traceback (most recent call last):
...
ValueError: Invalid value for argument `lr_factor`. Expected a float in (0, 1). Received: lr_factor=2.0
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
from typing import Any
from urllib.parse import urlsplit

__all__ = ["is_int", "is_number", "is_url", "check_url", "redact", "invalid_argument"]

#: Object-store URL schemes -> the fsspec driver package each needs (`pip install trainwell[cloud]`).
SCHEMES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def is_int(x: Any) -> bool:
    """Whether `x` is an integer (Python or numpy), a bool not counting as one.

    Args:
        x: The value to check.

    Example:
    >>> import numpy as np
    >>> is_int(np.int64(2)), is_int(2.0), is_int(False)
    (True, False, False)
    """
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x: Any, finite: bool = True) -> bool:
    """Whether `x` is a real number (Python or numpy, not a bool), by default also finite.

    Args:
        x: The value to check.
        finite: Whether NaN and infinities are refused. Defaults to `True`.

    Example:
    >>> is_number(1e-3), is_number(float("inf")), is_number(float("inf"), finite=False)
    (True, False, True)
    """
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and (not finite or math.isfinite(float(x)))


_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: Any) -> bool:
    """True when `path` is a `scheme://...` string (an object-store URL), False for a local path.

    Example:
    >>> is_url("gs://b/x"), is_url("/tmp/x")
    (True, False)
    """
    return isinstance(path, str) and _URL_RE.match(path) is not None


def invalid_argument(name: str, expected: str, value: Any, *, what: str = "argument", hint: str = "",
                     error: type[Exception] = ValueError) -> Exception:
    """The error for a bad value, in Keras's "Received:" idiom (the caller raises it): the one place it is worded.

    A function argument reads "Invalid value for argument `x`. Expected ...";
    a config field, command-line option or environment variable (`what` other
    than "argument") reads "Invalid value for `x`: <expected>.", where `expected`
    says what is wrong in lower case (e.g. "expected an integer >= 1").

    Args:
        name: The argument's (field's, option's, variable's) name.
        expected: What it should be, e.g. `"an int >= 1"`; for other than an
            argument, what is wrong.
        value: What was passed.
        what: What `name` is: `"argument"`, `""` (a config field or option) or,
            e.g., `"environment variable"`. Defaults to `"argument"`.
        hint: A sentence to add, starting with a space. Defaults to `""`.
        error: The exception class. Defaults to `ValueError`.

    Example:
    >>> str(invalid_argument("steps", "an int >= 1", 0))
    'Invalid value for argument `steps`. Expected an int >= 1. Received: steps=0'
    >>> str(invalid_argument("epochs", "expected an integer >= 1", 0, what=""))
    'Invalid value for `epochs`: expected an integer >= 1. Received: epochs=0'
    """
    if what == "argument":
        return error(f"Invalid value for argument `{name}`. Expected {expected}.{hint} Received: {name}={value!r}")
    subject = f"{what} `{name}`" if what else f"`{name}`"
    return error(f"Invalid value for {subject}: {expected}.{hint} Received: {name}={value!r}")


def invalid_value(name: str, expected: str, value: Any, *, what: str = "argument",
                  error: type[Exception] = ValueError) -> Exception:
    """`invalid_argument` with one wording of `expected` for an argument and a field alike.

    For other than an argument, "expected " is put before `expected`, so a check
    shared by a function argument and a config field words its message once.

    Example:
    >>> str(invalid_value("run_dir", "a URL naming a bucket", "s3://", what=""))
    "Invalid value for `run_dir`: expected a URL naming a bucket. Received: run_dir='s3://'"
    """
    return invalid_argument(name, expected if what == "argument" else f"expected {expected}", value,
                            what=what, error=error)


def redact(url: str) -> str:
    """`url` without any user-info (credentials): what a message may show.

    Example:
    >>> redact("s3://KEY:SECRET@bucket/run")
    's3://***@bucket/run'
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return f"{parts.scheme}://***@{parts.netloc.rsplit('@', 1)[1]}{parts.path}"


def check_url(url: str, name: str = "directory", *, what: str = "argument", error: type[Exception] = ValueError) -> str:
    """Validates an object-store URL; returns it without a trailing slash.

    Refused in one line (a ValueError in the "Received:" idiom, the secret
    redacted): credentials in the URL, an unknown scheme, no bucket, a scheme
    whose driver package is not installed.

    Args:
        url: A `scheme://bucket/prefix` URL. Required.
        name: The argument or field the URL came from, for the message.
        what: `invalid_argument`'s: `"argument"`, or `""` for a config field or option.
        error: The exception class. Defaults to `ValueError`.

    Returns:
        The URL, trailing slashes removed.

    Example:
    >>> check_url("s3://bucket/run/")
    's3://bucket/run'
    >>> check_url("ftp://host/x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Invalid value for argument `directory`. ... (scheme 'ftp' is not supported). Received: directory='ftp://host/x'
    """
    def refuse(expected: str, value: str) -> Exception:
        return invalid_value(name, expected, value, what=what, error=error)

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if "@" in parts.netloc:
        raise refuse(
            "a URL without credentials (they come from the environment: AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, config files or the metadata server)",
            redact(url),
        )
    if scheme not in SCHEMES:
        raise refuse(f"a local path or an s3:// or gs:// URL (scheme {scheme!r} is not supported)", url)
    if not parts.netloc:
        raise refuse(f"a {scheme}:// URL naming a bucket", url)
    package = SCHEMES[scheme]
    if importlib.util.find_spec(package) is None:
        raise refuse(
            f"a URL whose driver is installed ({scheme}:// needs {package}: pip install 'trainwell[cloud]')", url
        )
    return url.rstrip("/")
