"""Runtime: distribution strategy, precision policy, seeding, run directory.

These are thin, explicit wrappers over `tf.distribute` and
`keras.mixed_precision`: Keras already provides the machinery, what it lacks is
one call that picks the right thing for the machine (`"auto"`), a way to test data
parallelism without GPUs (`"cpu:N"` logical devices), and a run directory whose
manifest says exactly what ran.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime as _dt
import errno
import json
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from trainwell.config import MAX_SEED, ConfigError
from trainwell.io import atomic_write_json, atomic_write_text

STRATEGY_SPECS = ("auto", "mirrored", "multiworker", "tpu", "one_device", "cpu:N")
PRECISION_SPECS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")
_CPU_RE = re.compile(r"^cpu:(\d+)$")


def _tf():
    import tensorflow as tf

    return tf


def validate_strategy_spec(spec: Any) -> None:
    """Raises `ValueError` unless `spec` is a valid strategy spec or instance.

    Example:
    >>> validate_strategy_spec("cpu:2")
    """
    if isinstance(spec, str):
        m = _CPU_RE.match(spec)
        if spec in STRATEGY_SPECS[:-1] or (m and int(m.group(1)) >= 1):
            return
    elif isinstance(spec, _tf().distribute.Strategy):
        return
    raise ValueError(
        "Invalid value for argument `strategy`. Expected one of "
        f"{', '.join(repr(s) for s in STRATEGY_SPECS)} (N >= 1) or a "
        f"tf.distribute.Strategy. Received: strategy={spec!r}"
    )


def _tf_config_cluster() -> dict | None:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}). Received: TF_CONFIG={raw!r}") from None
    cluster = cfg.get("cluster") or {}
    n = sum(len(v) for v in cluster.values() if isinstance(v, list))
    return cfg if n > 1 else None


def _tpu_requested() -> bool:
    return bool(os.environ.get("TPU_NAME") or os.environ.get("COLAB_TPU_ADDR") or os.path.exists("/dev/accel0"))


def ensure_logical_cpus(n: int) -> list[str]:
    """Splits the host CPU into `n` logical devices and returns their names.

    Must run before TensorFlow initialises its devices (before the first op). If
    it already did with a different count, raises a `RuntimeError` that says so.

    Args:
        n: Number of logical CPU devices, >= 1.

    Returns:
        Device names, e.g. `["/cpu:0", "/cpu:1"]`.

    Example:
    >>> ensure_logical_cpus(2)  # doctest: +SKIP
    ['/cpu:0', '/cpu:1']
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"Invalid value for argument `n`. Expected an int >= 1. Received: n={n!r}")
    tf = _tf()
    cpus = tf.config.list_physical_devices("CPU")
    try:
        current = tf.config.get_logical_device_configuration(cpus[0])
    except Exception:  # pragma: no cover
        current = None
    if current is None or len(current) != n:
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
            )
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            if have != n:
                raise RuntimeError(
                    f"strategy='cpu:{n}' needs {n} logical CPU devices but TensorFlow is already "
                    f"initialised with {have}. Call trainwell.runtime.make_strategy('cpu:{n}') before "
                    "running any TensorFlow op (or start a fresh process)."
                ) from None
    return [f"/cpu:{i}" for i in range(n)]


def make_strategy(spec: Any = "auto"):
    """Returns a `tf.distribute.Strategy` for `spec`.

    Args:
        spec: One of:
            - `"auto"`: a TPU when one is configured (`TPU_NAME`, Colab, `/dev/accel0`),
              else `MultiWorkerMirroredStrategy` when `TF_CONFIG` names a cluster of more
              than one task, else `MirroredStrategy` over all GPUs, else the default
              (single-device) strategy.
            - `"mirrored"`: `MirroredStrategy` over all visible GPUs (or the CPU).
            - `"multiworker"`: `MultiWorkerMirroredStrategy` from `TF_CONFIG`.
            - `"tpu"`: `TPUStrategy` on the resolved TPU.
            - `"one_device"`: `OneDeviceStrategy` on the first GPU, else the CPU.
            - `"cpu:N"`: N logical CPU devices mirrored, so data parallelism can be tested
              without GPUs. Must be requested before TensorFlow initialises.
            - an existing `tf.distribute.Strategy`, returned as is.
            Defaults to `"auto"`.

    Returns:
        The strategy.

    Example:
    >>> strategy = make_strategy("auto")
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model = build_model()
    """
    validate_strategy_spec(spec)
    tf = _tf()
    if isinstance(spec, tf.distribute.Strategy):
        if isinstance(spec, tf.distribute.MultiWorkerMirroredStrategy):
            _apply_multiworker_fixes()
        return spec
    m = _CPU_RE.match(spec)
    if m:
        devices = ensure_logical_cpus(int(m.group(1)))
        if len(devices) == 1:
            return tf.distribute.OneDeviceStrategy(devices[0])
        return tf.distribute.MirroredStrategy(
            devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    if spec == "auto":
        if _tpu_requested():
            spec = "tpu"
        elif _tf_config_cluster() is not None:
            spec = "multiworker"
        elif tf.config.list_physical_devices("GPU"):
            spec = "mirrored"
        else:
            return tf.distribute.get_strategy()
    if spec == "mirrored":
        return tf.distribute.MirroredStrategy()
    if spec == "one_device":
        gpus = tf.config.list_logical_devices("GPU")
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
    if spec == "multiworker":
        return _make_multiworker(tf)
    # spec == "tpu"
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=os.environ.get("TPU_NAME", ""))
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def _apply_multiworker_fixes() -> None:
    from trainwell import keras_fixes

    keras_fixes.apply()


#: Environment variable: seconds a cross-worker collective may wait for a peer
#: before it fails (`CommunicationOptions(timeout_seconds=...)`); unset or `0`:
#: no per-collective timeout. A crashed peer is detected without it: TensorFlow's
#: coordination service aborts the collectives of the others when the peer stops
#: sending heartbeats (seconds on loopback). The timeout also catches a peer that
#: is alive but stuck; keep it above the slowest step + the chief's checkpoint write.
COLLECTIVE_TIMEOUT_ENV = "TRAINWELL_COLLECTIVE_TIMEOUT_S"
#: Default of `COLLECTIVE_TIMEOUT_ENV` (None: no per-collective timeout).
DEFAULT_COLLECTIVE_TIMEOUT_S = None


def collective_timeout_s() -> float | None:
    """Seconds a multi-worker collective waits for a peer (`None`: forever).

    Read from the environment variable `TRAINWELL_COLLECTIVE_TIMEOUT_S`
    (unset or `0`: no timeout).

    Example:
    >>> collective_timeout_s() is None or collective_timeout_s() > 0
    True
    """
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "")
    if not raw.strip():
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"Invalid value for environment variable `{COLLECTIVE_TIMEOUT_ENV}`. Expected seconds >= 0. "
            f"Received: {COLLECTIVE_TIMEOUT_ENV}={raw!r}"
        ) from None
    if not value >= 0:
        raise ValueError(
            f"Invalid value for environment variable `{COLLECTIVE_TIMEOUT_ENV}`. Expected seconds >= 0. "
            f"Received: {COLLECTIVE_TIMEOUT_ENV}={raw!r}"
        )
    return value or None


def _make_multiworker(tf):
    _apply_multiworker_fixes()
    timeout = collective_timeout_s()
    if timeout is None:
        return tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def num_workers(strategy) -> int:
    """Number of worker processes taking part in `strategy` (1 unless multi-worker).

    Example:
    >>> num_workers(None)
    1
    """
    if strategy is None:
        return 1
    n = getattr(getattr(strategy, "extended", None), "_num_workers", None)
    return int(n) if isinstance(n, int) and n > 0 else 1


def any_across_workers(strategy, flags, flags_fn=None):
    """Element-wise OR of boolean `flags` over every replica of `strategy`.

    A decision that changes the training state (roll back, checkpoint and exit)
    must be taken by every worker at the same step, or the workers' weights part
    and their collectives stop matching. Each replica contributes its process's
    flags (or `flags_fn(replica_id)`); one all-reduce of a small int32 vector sums
    them, and a flag is set in the result when any replica set it. With a single
    worker this is a plain copy of `flags` (no device work) unless `flags_fn` is
    given.

    It is a collective under multi-worker: every worker must call it the same
    number of times, in the same order.

    Args:
        strategy: The `tf.distribute.Strategy` (or `None`: no reduction).
        flags: Sequence of booleans, this process's view.
        flags_fn: Optional `replica_id_in_sync_group -> sequence of booleans`, the
            flags of each replica (for tests: replicas that disagree). Defaults to
            `None` (every local replica contributes `flags`).

    Returns:
        A list of booleans, the same on every worker.

    Example:
    >>> any_across_workers(None, [False, True])
    [False, True]
    """
    local = [bool(f) for f in flags]
    if strategy is None or (flags_fn is None and num_workers(strategy) <= 1):
        return local
    tf = _tf()
    n = len(local)

    def value_fn(ctx):
        vals = flags_fn(ctx.replica_id_in_sync_group) if flags_fn is not None else local
        if len(vals) != n:
            raise ValueError(f"flags_fn returned {len(vals)} flags, expected {n}. Received: {vals!r}")
        return tf.constant([1 if v else 0 for v in vals], dtype=tf.int32)

    per_replica = strategy.experimental_distribute_values_from_function(value_fn)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    return [bool(x > 0) for x in np.asarray(total).reshape(-1)]


def sync_workers(strategy) -> None:
    """Returns once every worker of `strategy` has called it: a barrier (one small all-reduce).

    A no-op with a single worker. Multi-worker runs call it last (the `trainwell`
    command does, after printing the result): a worker that exits while the chief
    still evaluates, plots or exports looks like a crash to TensorFlow's coordination
    service, which the chief hosts. A barrier that fails (a peer is gone or a
    collective timed out, see `TRAINWELL_COLLECTIVE_TIMEOUT_S`) is ignored: the run
    itself is done.

    Args:
        strategy: The run's `tf.distribute.Strategy`, or `None`.

    Example:
    >>> sync_workers(None)
    """
    if num_workers(strategy) <= 1:
        return
    try:
        any_across_workers(strategy, [False])
    except Exception:  # noqa: BLE001 - a failed barrier at the very end changes nothing
        pass


def num_replicas(strategy) -> int:
    """Number of replicas in sync of `strategy` (1 for the default strategy).

    Example:
    >>> num_replicas(make_strategy("auto"))  # doctest: +SKIP
    1
    """
    return int(getattr(strategy, "num_replicas_in_sync", 1))


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs, e.g. `[(9, 0)]` on an H100/H200.

    Example:
    >>> gpu_compute_capabilities()  # doctest: +SKIP
    []
    """
    tf = _tf()
    caps = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        cc = details.get("compute_capability")
        if cc:
            caps.append(tuple(int(c) for c in cc))
    return caps


def resolve_precision(spec: str = "auto") -> str:
    """Resolves a precision spec to a Keras dtype policy name without setting it.

    `"auto"` is `mixed_bfloat16` on TPU, `mixed_float16` when every GPU has compute
    capability >= 7.0 (tensor cores), and `float32` otherwise (CPU). Explicit
    policies are returned unchanged.

    Example:
    >>> resolve_precision("float32")
    'float32'
    """
    if spec not in PRECISION_SPECS:
        raise ValueError(
            "Invalid value for argument `precision`. Expected one of "
            f"{', '.join(repr(s) for s in PRECISION_SPECS)}. Received: precision={spec!r}"
        )
    if spec != "auto":
        return spec
    tf = _tf()
    if _tpu_requested() or tf.config.list_logical_devices("TPU"):
        return "mixed_bfloat16"
    caps = gpu_compute_capabilities()
    if caps and all(c >= (7, 0) for c in caps):
        return "mixed_float16"
    return "float32"


def set_precision(spec: str = "auto") -> str:
    """Sets Keras's global dtype policy and returns its name.

    Args:
        spec: `"auto"`, `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`. See
            `resolve_precision` for what `"auto"` picks. Explicit policies are
            honoured on every device (mixed_float16 runs on the CPU too, slowly).
            Defaults to `"auto"`.

    Returns:
        The policy name that is now global.

    Example:
    >>> set_precision("float32")
    'float32'
    """
    import keras

    name = resolve_precision(spec)
    keras.mixed_precision.set_global_policy(name)
    return name


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seeds Python, NumPy, TensorFlow and Keras; optionally makes ops deterministic.

    Uses `keras.utils.set_random_seed` (Python `random`, NumPy, TF and the Keras
    backend seed generator) and, with `deterministic=True`,
    `tf.config.experimental.enable_op_determinism()`, which makes reruns on the
    same hardware bit-identical at some cost in speed.

    Args:
        seed: An integer in [0, 2**32 - 1] (NumPy's legacy seed takes 32 bits).
        deterministic: Whether to enable op determinism. Defaults to `False`.

    Example:
    >>> seed_everything(42)
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(
            f"Invalid value for argument `seed`. Expected an int in [0, 2**32 - 1] (NumPy's seed range). "
            f"Received: seed={seed!r}"
        )
    import keras

    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    keras.utils.set_random_seed(seed)
    if deterministic:
        _tf().config.experimental.enable_op_determinism()


# --------------------------------------------------------------------------- run dir


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a run depends on (missing ones omitted).

    Example:
    >>> "python" in package_versions()
    True
    """
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in (
        "trainwell",
        "tensorflow",
        "keras",
        "keras-tuner",
        "tensorflow-datasets",
        "keras-hub",
        "numpy",
        "matplotlib",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """The git commit of the repository holding `path` (default: cwd), or None.

    A `+dirty` suffix marks uncommitted changes.

    Example:
    >>> git_commit("/")  # doctest: +SKIP
    """
    cwd = os.fspath(path) if path else os.getcwd()
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, timeout=5,
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_summary() -> list[dict[str, str]]:
    """Physical devices TensorFlow sees, with GPU names and compute capability.

    Example:
    >>> device_summary()[0]["type"]  # doctest: +SKIP
    'CPU'
    """
    tf = _tf()
    out = []
    for d in tf.config.list_physical_devices():
        entry = {"name": d.name, "type": d.device_type}
        if d.device_type == "GPU":
            details = tf.config.experimental.get_device_details(d)
            entry.update({k: str(v) for k, v in details.items()})
        out.append(entry)
    return out


def make_run_dir(run_dir: str | os.PathLike | None, prefix: str = "run", root: str = "runs") -> Path:
    """Creates (or reuses) a run directory and returns its path.

    Args:
        run_dir: Directory to use. An existing one is reused, which is how a run
            resumes. `None` makes `root/PREFIX-YYYYmmdd-HHMMSS` (with a numeric
            suffix if that exists).
        prefix: Name prefix when `run_dir` is None. Defaults to `"run"`.
        root: Parent directory when `run_dir` is None. Defaults to `"runs"`.

    Example:
    >>> import tempfile
    >>> make_run_dir(tempfile.mkdtemp()).is_dir()
    True
    """
    if run_dir is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        base = Path(root) / f"{prefix}-{stamp}"
        path, i = base, 1
        while path.exists():
            path = Path(f"{base}-{i}")
            i += 1
    else:
        path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"Invalid value for `run_dir`: not a directory. Received: run_dir={str(path)!r}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def shared_run_dir(
    run_dir: str | os.PathLike | None, strategy=None, prefix: str = "run", root: str = "runs"
) -> Path:
    """`make_run_dir` that every worker of a multi-worker job agrees on.

    A given `run_dir` is used as is by every worker. With `run_dir=None`, each
    worker would otherwise stamp its own `root/PREFIX-YYYYmmdd-HHMMSS` (clocks and
    start times differ), so under multi-worker the chief picks the name (stamp and
    collision suffix, as `make_run_dir` does) and sends it to the others with one
    all-reduce; the others use the chief's name. On a cluster the run directory
    should be on a filesystem every host mounts at the same path (the chief
    writes there; the others only read checkpoints to resume).

    Args:
        run_dir: Directory to use, or `None` for the chief's timestamped name.
        strategy: The strategy in use. Defaults to `None` (single process).
        prefix: Name prefix when `run_dir` is None. Defaults to `"run"`.
        root: Parent directory when `run_dir` is None. Defaults to `"runs"`.

    Returns:
        The path, created on this host.

    Example:
    >>> import tempfile
    >>> shared_run_dir(tempfile.mkdtemp()).is_dir()
    True
    """
    if run_dir is not None or num_workers(strategy) <= 1:
        return make_run_dir(run_dir, prefix=prefix, root=root)
    chief = is_chief(strategy)
    stamp, suffix = 0, 0
    if chief:
        path = make_run_dir(None, prefix=prefix, root=root)
        m = re.match(rf"^{re.escape(prefix)}-(\d{{8}})-(\d{{6}})(?:-(\d+))?$", path.name)
        stamp, suffix = int(m.group(1) + m.group(2)), int(m.group(3) or 0)
    # Replica 0 lives on the chief (the first task of the collective group): it
    # alone contributes, so the SUM is the chief's value whatever the replica count.
    tf = _tf()

    def value_fn(ctx):
        keep = ctx.replica_id_in_sync_group == 0
        return tf.constant([stamp if keep else 0, suffix if keep else 0], dtype=tf.int64)

    per_replica = strategy.experimental_distribute_values_from_function(value_fn)
    got = np.asarray(strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)).reshape(-1)
    s = f"{int(got[0]):014d}"
    name = f"{prefix}-{s[:8]}-{s[8:]}" + (f"-{int(got[1])}" if int(got[1]) else "")
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


#: The lock file in a run directory (see `lock_run_dir`).
LOCK_FILE = ".trainwell.lock"


class RunDirInUseError(ConfigError):
    """Another live process holds the run directory's lock; the message names it."""


class RunDirLock:
    """The lock one process holds on a run directory (see `lock_run_dir`).

    Example:
    >>> import tempfile
    >>> lock = lock_run_dir(tempfile.mkdtemp())
    >>> lock.release()
    """

    def __init__(self, run_dir: Path, fd: int | None):
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd = fd
        self._count = 1

    @property
    def held(self) -> bool:
        """Whether this process still holds the lock."""
        return self._count > 0

    def release(self) -> None:
        """Releases one hold; the last one deletes the lock file and unlocks it."""
        if self._count <= 0:
            return
        self._count -= 1
        if self._count:
            return
        _HELD.pop(_lock_key(self.run_dir), None)
        try:
            self.path.unlink()  # while still locked: a waiting process then finds no file or a new one
        except OSError:
            pass
        if self._fd is not None:
            try:
                os.close(self._fd)  # drops the flock
            except OSError:
                pass
            self._fd = None


_HELD: dict[str, RunDirLock] = {}


def _lock_key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else (or cannot tell)
    return True


def _holder(path: Path) -> dict:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _in_use(run_dir: Path, info: dict) -> RunDirInUseError:
    who = f"process {info.get('pid', '?')} on host {info.get('host', '?')}"
    since = f" since {info['since']}" if info.get("since") else ""
    cmd = f" ({' '.join(str(c) for c in info['command'])[:200]})" if info.get("command") else ""
    return RunDirInUseError(
        f"Run directory {str(run_dir)!r} is in use by {who}{since}{cmd}. Wait for that run to end, or use "
        "another run_dir; if that process is gone, delete " + str(run_dir / LOCK_FILE) + "."
    )


def _holder_record() -> bytes:
    return json.dumps({
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable] + sys.argv,
    }).encode("utf-8")


def lock_run_dir(run_dir: str | os.PathLike) -> RunDirLock:
    """Takes the run directory's lock for this process, or fails naming the holder.

    Two processes writing one run directory interleave their checkpoints, manifest
    and `history.csv`. The lock is `fcntl.flock` on `RUN_DIR/.trainwell.lock`: the
    kernel drops it when the holder exits or dies (SIGKILL included), so a crashed
    run never blocks the next. The file records the holder (pid, host, start,
    command) for the error message. Where `flock` is unavailable (Windows, some
    network filesystems) the record itself is the lock: a record whose pid no
    longer runs on this host is stale and taken over; one from another host is
    refused (delete the file once that run is over). Within one process the lock
    is re-entrant (a notebook that trains the same run again). Under multi-worker
    only the chief takes it (the workers share the chief's run directory).

    Args:
        run_dir: An existing run directory.

    Returns:
        A `RunDirLock`; `release()` it when the run ends (it is also released
        when the process exits).

    Raises:
        RunDirInUseError: Another live process holds the lock (a `ConfigError`:
            one line).

    Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> lock = lock_run_dir(d)
    >>> lock_run_dir(d) is lock  # re-entrant in one process
    True
    >>> lock.release(); lock.release()
    """
    run_dir = Path(run_dir)
    held = _HELD.get(_lock_key(run_dir))
    if held is not None and held.held:
        held._count += 1
        return held
    path = run_dir / LOCK_FILE
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if fcntl is not None else None
        if fd is None:
            return _lock_by_record(run_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _in_use(run_dir, _holder(path)) from None
            return _lock_by_record(run_dir)  # ENOLCK, EOPNOTSUPP, ...: no flock on this filesystem
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except OSError:
            same = False
        if not same:  # the previous holder deleted the file after we opened it: lock the new one
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, _holder_record())
        return _register(RunDirLock(run_dir, fd))
    raise _in_use(run_dir, _holder(path))


def _lock_by_record(run_dir: Path) -> RunDirLock:
    path = run_dir / LOCK_FILE
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            info = _holder(path)
            pid = info.get("pid")
            if info.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
                try:
                    path.unlink()  # stale: its process is gone
                except OSError:
                    pass
                continue
            raise _in_use(run_dir, info) from None
        try:
            os.write(fd, _holder_record())
        finally:
            os.close(fd)
        return _register(RunDirLock(run_dir, None))
    raise _in_use(run_dir, _holder(path))


def _register(lock: RunDirLock) -> RunDirLock:
    _HELD[_lock_key(lock.run_dir)] = lock
    return lock


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        lock._count = 1
        lock.release()


def is_chief(strategy=None) -> bool:
    """Whether this process is the chief (the one that writes run artifacts).

    True for single-process runs; under multi-worker, the `chief` task or worker 0
    when the cluster has no chief.

    Example:
    >>> is_chief()
    True
    """
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    if resolver is not None and getattr(resolver, "task_type", None) is not None:
        task_type, task_id = resolver.task_type, resolver.task_id
        spec = resolver.cluster_spec().as_dict()
    else:
        raw = os.environ.get("TF_CONFIG")
        if not raw:
            return True
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError:
            return True
        task = cfg.get("task") or {}
        task_type, task_id = task.get("type"), task.get("index", 0)
        spec = cfg.get("cluster") or {}
    if task_type is None:
        return True
    if task_type == "chief":
        return True
    return task_type == "worker" and int(task_id or 0) == 0 and "chief" not in spec


def write_manifest(
    run_dir: str | os.PathLike,
    config: Any = None,
    *,
    strategy=None,
    precision: str | None = None,
    seed: int | None = None,
    recipe: str | None = None,
    extra: dict | None = None,
) -> Path:
    """Writes `manifest.json` (and `config.yaml` for a dataclass config) to `run_dir`.

    The manifest records what ran: package versions, git commit, devices, strategy
    and number of replicas, precision policy, seed, command line, host and time.

    Args:
        run_dir: The run directory.
        config: The resolved config (a dataclass or a dict). Defaults to `None`.
        strategy: The strategy in use. Defaults to `None`.
        precision: The precision policy in use. Defaults to `None`.
        seed: The seed. Defaults to `None`.
        recipe: Recipe name, so `trainwell resume` knows what to run. Defaults to `None`.
        extra: More entries to record. Defaults to `None`.

    Returns:
        The manifest path.

    Example:
    >>> import tempfile
    >>> write_manifest(tempfile.mkdtemp(), {"epochs": 1}, seed=0).name
    'manifest.json'
    """
    run_dir = Path(run_dir)
    cfg_dict = _config_dict(config)
    manifest = {
        "recipe": recipe,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable] + sys.argv,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "versions": package_versions(),
        "git_commit": git_commit(Path(__file__).resolve().parent) or git_commit(),
        "devices": device_summary(),
        "strategy": type(strategy).__name__ if strategy is not None else None,
        "num_replicas": num_replicas(strategy) if strategy is not None else None,
        "precision": precision,
        "seed": seed,
        "config": cfg_dict,
    }
    if extra:
        manifest.update(extra)
    if cfg_dict is not None:
        import yaml

        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(cfg_dict, sort_keys=False))
    return atomic_write_json(run_dir / "manifest.json", manifest)


def _config_dict(config: Any) -> dict | None:
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)
