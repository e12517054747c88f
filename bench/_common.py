"""Shared helpers of the `bench/` scripts: logging, JSON output, step timing, machine info.

Every benchmark prints exactly one JSON object on stdout (`print_json`); progress
and logs go to stderr (`log`). Timings that compare "ours" with a baseline are taken
in one run, alternating the two, because the machines these run on are shared.

Example:
>>> from bench._common import log, print_json  # doctest: +SKIP
>>> print_json({"benchmark": "x", "ours": 1.0})  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Iterable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_T0 = time.perf_counter()


def log(*parts: Any) -> None:
    """Prints a progress line to stderr, prefixed with the seconds since start.

    Example:
    >>> log("building model")  # doctest: +SKIP
    """
    print(f"[{time.perf_counter() - _T0:7.1f}s]", *parts, file=sys.stderr, flush=True)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / tf scalars
        try:
            x = x.item()
        except Exception:  # pragma: no cover
            x = float(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def print_json(obj: dict) -> None:
    """Prints `obj` as one JSON object on stdout (NaN/inf become `null`).

    Example:
    >>> print_json({"speedup": 1.2})  # doctest: +SKIP
    {"speedup": 1.2}
    """
    sys.stdout.write(json.dumps(_jsonable(obj), indent=1) + "\n")
    sys.stdout.flush()


def rnd(x: float | None, digits: int = 2) -> float | None:
    """Rounds, passing `None` (and non-finite values, as `None`) through.

    Example:
    >>> rnd(1.23456)
    1.23
    """
    if x is None:
        return None
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None


def summary(values: Iterable[float]) -> dict[str, float | None]:
    """`{"mean", "min", "max", "median"}` of the finite values (all `None` if none).

    Example:
    >>> summary([1.0, 3.0])["mean"]
    2.0
    """
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return {"mean": None, "min": None, "max": None, "median": None}
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "median": statistics.median(v)}


def cores() -> int:
    """CPU cores this process may run on.

    Example:
    >>> cores() >= 1
    True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover


def load_avg() -> float | None:
    """The 1-minute load average (how busy the shared machine was), or `None`.

    Example:
    >>> load_avg() is None or load_avg() >= 0
    True
    """
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


def machine_info() -> dict[str, Any]:
    """Host, cores, load, CPU model, GPUs and package versions, for the JSON output.

    Example:
    >>> "cores" in machine_info()  # doctest: +SKIP
    True
    """
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "cores": cores(),
        "load_avg_1min_start": load_avg(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    try:
        import keras
        import tensorflow as tf

        info["tensorflow"] = tf.__version__
        info["keras"] = keras.__version__
        gpus = []
        for d in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(d)
            gpus.append({"name": details.get("device_name", d.name),
                         "compute_capability": details.get("compute_capability")})
        info["gpus"] = gpus
    except Exception as e:  # pragma: no cover
        info["tf_error"] = repr(e)
    return info


class StepTimer:
    """Records the wall-clock time at which each `fit` execution finished.

    A factory for a `keras.callbacks.Callback` (built lazily so importing this
    module does not import Keras). `on_train_batch_end` receives the logs after
    Keras turned them into Python numbers, i.e. after the step's loss was computed,
    so the recorded time is the end of the step, not the end of its dispatch. It is
    marked `async_safe`, so adding it does not take Keras's fit loop out of its
    asynchronous-callback mode (which it leaves as soon as any callback that is not
    async-safe overrides a batch hook).

    Example:
    >>> timer = StepTimer.make()  # doctest: +SKIP
    >>> model.fit(ds, steps_per_epoch=10, callbacks=[timer])  # doctest: +SKIP
    >>> timer.images_per_s(batch_size=16, skip=1)  # doctest: +SKIP
    """

    @staticmethod
    def make():
        import keras

        class _Timer(keras.callbacks.Callback):
            async_safe = True

            def __init__(self):
                super().__init__()
                self.ends: list[tuple[int, float, float]] = []
                self.train_begin = self.train_end = None

            def on_train_begin(self, logs=None):
                self.ends = []
                self.train_begin = time.perf_counter()

            def on_train_end(self, logs=None):
                self.train_end = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                if logs:
                    for v in logs.values():  # already numbers; a tensor would be synced here
                        float(v)
                        break
                self.ends.append((int(batch), time.perf_counter(), time.process_time()))

            def timed(self, skip: int = 1) -> tuple[int, float, float]:
                """(steps, wall seconds, process CPU seconds) of the last fit after its first `skip` >= 1 executions."""
                ends = sorted(self.ends)
                if skip < 1 or len(ends) <= skip:
                    raise RuntimeError(f"Too few executions ({len(ends)}) to skip {skip}: raise --steps.")
                (b0, t0, c0), (b1, t1, c1) = ends[skip - 1], ends[-1]
                return b1 - b0, t1 - t0, c1 - c0

            def images_per_s(self, batch_size: int, skip: int = 1) -> float:
                steps, seconds, _ = self.timed(skip)
                return steps * batch_size / seconds

            def first_end(self) -> float | None:
                """Seconds from train begin to the end of the first execution."""
                return min(t for _, t, _ in self.ends) - self.train_begin if self.ends else None

            def tail(self) -> float | None:
                """Seconds from the end of the last execution to train end (epoch-end work)."""
                return self.train_end - max(t for _, t, _ in self.ends) if self.ends and self.train_end else None

        return _Timer()


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    """`a / b` rounded, or `None` when either is missing or `b` is 0.

    Example:
    >>> ratio(3.0, 2.0)
    1.5
    """
    if a is None or b is None or not b:
        return None
    return round(float(a) / float(b), digits)


def parse_seeds(text: str) -> list[int]:
    """`"3"` -> `[0, 1, 2]`; `"0,4,7"` -> `[0, 4, 7]`."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if len(parts) == 1:
        n = int(parts[0])
        if n < 1:
            raise ValueError(f"Invalid value for argument `--seeds`. Expected >= 1. Received: seeds={text!r}")
        return list(range(n))
    return [int(p) for p in parts]


def run_worker(script: str, kind: str, seed: int, extra: list[str], cwd) -> dict:
    """Runs `script --worker KIND --seed SEED EXTRA...` in a fresh process; its last stdout line is JSON.

    Each measured run gets its own interpreter so no state (compiled functions, RNG,
    allocator) leaks from one arm into the other. Adds `subprocess_wall_s`.
    """
    cmd = [sys.executable, os.path.abspath(script), "--worker", kind, "--seed", str(seed), *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, cwd=str(cwd))
    if r.returncode != 0:
        raise RuntimeError(f"{kind} run for seed {seed} failed with exit code {r.returncode}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["subprocess_wall_s"] = time.perf_counter() - t0
    return out


def alternate(seeds, kinds, run, on_row=None, tmp_prefix="trainwell-bench-", keep=False) -> list[dict]:
    """Runs `run(kind, seed, tmp)` for every seed and kind, alternating which kind goes first.

    Alternating the order per seed makes both arms see the same load on a shared
    machine. `on_row(row)` may add per-seed comparisons to `row` (`{"seed", "order",
    kind: result, ...}`). The temporary directory is removed unless `keep`.
    """
    import shutil
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix))
    rows = []
    try:
        for i, seed in enumerate(seeds):
            order = list(kinds) if i % 2 == 0 else list(reversed(kinds))
            row = {"seed": seed, "order": order}
            for kind in order:
                log(f"seed {seed}: {kind} ...")
                row[kind] = run(kind, seed, tmp)
                r = row[kind]
                log(f"seed {seed}: {kind} test_accuracy={r.get('test_accuracy', float('nan')):.4f} "
                    f"wall={r.get('wall_s', float('nan')):.1f}s")
            if on_row is not None:
                on_row(row)
            rows.append(row)
    finally:
        if keep:
            log(f"run directories kept under {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows
