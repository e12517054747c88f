"""The run directory: where a run writes, its manifest, and the lock one process holds on it.

Keras writes a run's pieces (checkpoints, `CSVLogger`, `TensorBoard`) wherever
each is told; what it lacks is one directory per run that every worker agrees on
(`shared_run_dir`), a manifest that says exactly what ran (`write_manifest`:
versions, git commit, devices, strategy, precision, seed, command), and a lock so
two processes never write one run directory at once (`lock_run_dir`).

Example:
>>> import tempfile
>>> d = make_run_dir(tempfile.mkdtemp())
>>> lock = lock_run_dir(d); lock.release()
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime as _dt
import errno
import functools
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from trainwell.config import ConfigError, os_error_reason
from trainwell.io import atomic_write_json, atomic_write_text
from trainwell.runtime import broadcast_from_chief, is_chief, num_replicas, num_workers
from trainwell.validation import invalid_argument


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a run depends on (missing ones omitted).

    Read once per process (every PBT segment writes a manifest; bench/README.md
    has the cost of the look-ups); a copy is returned.

    Example:
    >>> "python" in package_versions()
    True
    """
    return dict(_package_versions())


@functools.lru_cache(maxsize=1)
def _package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "trainwell",
        "tensorflow",
        "keras",
        "keras-tuner",
        "tensorflow-datasets",
        "keras-hub",
        "jax",
        "jaxlib",
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
    import tensorflow as tf  # lazy: importing the run directory's helpers does not load TensorFlow
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
    return make_writable_dir(path, "run_dir" if run_dir is not None else None, what="run directory")


def make_writable_dir(path: str | os.PathLike, name: str | None = None, what: str = "directory",
                      writable: bool = True) -> Path:
    """Makes `path` (and its missing parents) and checks that a file can be written in it.

    A directory that cannot be made or written (a read-only file system, permission
    denied, a file where a directory is expected, a location such as `/proc` that
    refuses new entries even to root) is a one-line `ConfigError` naming the path
    and why; the parents it made are removed again, so nothing is left behind. The
    write check creates and deletes one empty file.

    Args:
        path: The directory. Required.
        name: The config field or option that gave it (named with "Received:"), or
            `None` for a default. Defaults to `None`.
        what: What the directory is, for the message. Defaults to `"directory"`.
        writable: Check that a file can be written in it (`False`: a directory this
            process only reads). Defaults to `True`.

    Returns:
        The path.

    Raises:
        trainwell.config.ConfigError: It cannot be made or written.

    Example:
    >>> import tempfile
    >>> make_writable_dir(Path(tempfile.mkdtemp()) / "a" / "b").is_dir()
    True
    """
    path = Path(path)
    missing = []  # deepest first: what this call makes, and removes again when it fails
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    try:
        if os.path.lexists(path) and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
        path.mkdir(parents=True, exist_ok=True)
        if writable:
            fd, probe = tempfile.mkstemp(prefix=".trainwell-write-check-", dir=path)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        for p in missing:
            try:
                p.rmdir()
            except OSError:
                pass
        raise _unusable_dir(path, name, what, e, missing) from None
    return path


def _unusable_dir(path: Path, name: str | None, what: str, e: OSError, missing: list[Path]) -> ConfigError:
    existing = next((p for p in path.parents if os.path.lexists(p)), None) if missing else path
    if e.errno == errno.ENOENT and existing is not None and existing.is_dir():
        reason = f"{str(existing)!r} does not accept new entries"  # e.g. /proc, even for root
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):
        bad = next((p for p in (path, *path.parents) if os.path.lexists(p) and not p.is_dir()), path)
        reason = ("it is" if bad == path else f"{str(bad)!r} is") + " a file, not a directory"
    else:
        reason = os_error_reason(e) + (f" ({e.filename!r})" if e.filename and Path(e.filename) != path else "")
    body = f"cannot use {str(path)!r} as the {what}: {reason}."
    if name is None:
        hint = " Set `run_dir` to a directory you can write." if what == "run directory" else ""
        return ConfigError(body[0].upper() + body[1:] + hint)
    return invalid_argument(name, body.rstrip("."), str(path), what="", error=ConfigError)


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
    got = broadcast_from_chief(strategy, [stamp, suffix])  # every worker names the chief's directory
    s = f"{int(got[0]):014d}"
    name = f"{prefix}-{s[:8]}-{s[8:]}" + (f"-{int(got[1])}" if int(got[1]) else "")
    # The other workers only read it (their checkpoint writes go to temporary directories).
    return make_writable_dir(Path(root) / name, None, what="run directory", writable=chief)


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
        import fcntl  # optional: POSIX only; where it is missing (Windows) the record itself is the lock
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


def release_run_dir_lock(run_dir: str | os.PathLike) -> None:
    """Releases this process's lock of `run_dir`, however many holds it has; a no-op without one.

    For a lock whose holder cannot release it: a `fit` that died in a callback never
    runs `Checkpoint.on_train_end`, and the recipes release the lock of their
    checkpoint directory with this when their run ends, so that another process (a
    `trainwell resume` from a terminal beside a notebook's kernel) can take it.

    Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp(); _ = lock_run_dir(d); _ = lock_run_dir(d)
    >>> release_run_dir_lock(d)
    >>> (Path(d) / LOCK_FILE).exists()
    False
    """
    lock = _HELD.get(_lock_key(run_dir))
    if lock is not None:
        lock._count = 1
        lock.release()


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        release_run_dir_lock(lock.run_dir)


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

    The manifest records what ran: the Keras backend, package versions, git commit, devices, strategy
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
    from trainwell.compat.backend import backend_name  # lazy: it imports Keras, which this module otherwise need not

    run_dir = Path(run_dir)
    cfg_dict = _config_dict(config)
    manifest = {
        "recipe": recipe,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable] + sys.argv,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "backend": backend_name(),
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
