"""One file-system layer: local paths keep POSIX renames and fsyncs, `s3://`/`gs://` URLs go through fsspec.

Why fsspec (over `tf.io.gfile` or `etils.epath`): it is already pinned (constraints.txt), it
is backend-neutral (no TensorFlow import on the JAX backend), its S3 and GCS drivers
(`s3fs`, `gcsfs`) take credentials from the standard SDK chains (environment, config files,
metadata server) and the endpoint from `AWS_ENDPOINT_URL` (MinIO, Ceph, moto), and one
`pipe` is one PUT, which is what the commit protocol below needs. The drivers are an
extra (`pip install trainwell[cloud]`); a local run never imports them.

Local paths (no `scheme://`) keep today's code: a checkpoint is written into a
temporary directory, each file fsynced, committed with one `os.rename`
(`commit_directory`), and the index replaced with another (`write_index`).

On an object store there is no rename. `ObjectStore` gives the protocol its
pieces: a checkpoint's objects go under a fresh prefix (`ckpt-<step>-<8 hex>`),
the index object is PUT last (one PUT is atomic on S3 and GCS), a reader trusts
only what the index lists (and verifies checksums), and prefixes that no index
lists are garbage from a killed writer, removed by the next writer
(`ObjectStore.remove_unlisted`). A lease object (`.writer-lease`) keeps a second
writer off a run (`ObjectStore.acquire_lease`).

Credentials never come from a URL: one that embeds them is refused (`check_url`),
and no URL this module reports carries any.

Example:
>>> is_url("s3://bucket/run"), is_url("runs/exp1")
(True, False)
>>> join("s3://bucket/run", "ckpt-3")
's3://bucket/run/ckpt-3'
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from trainwell.io import FILE_MODE, fsync_dir
from trainwell.rundir import RunDirInUseError
# is_url, check_url, redact, SCHEMES: part of this module's API too (validation holds them: config checks URLs)
from trainwell.validation import SCHEMES, check_url, invalid_value, is_url, redact  # noqa: F401

LEASE_OBJECT = ".writer-lease"
LEASE_SECONDS = 600.0


def join(base: str, *parts: str) -> str:
    """`base/part/...`: a URL joined with '/', a local path with `os.path.join`.

    Example:
    >>> join("s3://b/run", "ckpt-1", "state.json")
    's3://b/run/ckpt-1/state.json'
    """
    if is_url(base):
        return "/".join([base.rstrip("/"), *parts])
    return os.path.join(base, *parts)


class ObjectStore:
    """The objects under one URL prefix, through fsspec: PUT, GET, list, delete, and a writer lease.

    Every operation names objects relative to the prefix. Errors of the
    driver reach the caller as OSError (`FileNotFoundError`,
    `PermissionError`), which the checkpoint code reports in one line.

    Args:
        url: `s3://bucket/prefix` or `gs://bucket/prefix` (`check_url`). Required.

    Example:
    >>> store = ObjectStore("s3://bucket/run/checkpoints")  # doctest: +SKIP
    >>> store.put("a.txt", b"hi"); store.get("a.txt")  # doctest: +SKIP
    b'hi'
    """

    def __init__(self, url: str):
        import fsspec  # here, not at the top: a local run never needs fsspec's drivers (import time)

        self.url = check_url(url)
        scheme = urlsplit(self.url).scheme.lower()
        options = {}
        if scheme == "s3" and os.environ.get("AWS_ENDPOINT_URL"):
            options["client_kwargs"] = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
        self.fs, self.root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **options)
        self.root = self.root.rstrip("/")
        self.bucket = self.root.split("/", 1)[0]

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def check_bucket(self, name: str = "directory", *, what: str = "argument",
                     error: type[Exception] = ValueError) -> None:
        """Raises a one-line `error` when the bucket does not exist or cannot be reached.

        Args:
            name, what, error: The field the URL came from, as `check_url` takes them.

        Example:
        >>> ObjectStore("s3://no-such-bucket/x").check_bucket()  # doctest: +SKIP
        """
        def refuse(expected: str) -> Exception:
            return invalid_value(name, expected, self.url, what=what, error=error)

        try:
            ok = self.fs.exists(self.bucket)
        except PermissionError as e:
            raise refuse(f"a bucket this process may access ({e})") from None
        except OSError as e:
            raise refuse(f"a reachable bucket ({type(e).__name__}: {e})") from None
        if not ok:
            try:  # `exists` answers False for a server it cannot reach too: ask again where the error shows
                self.fs.ls(self.bucket, refresh=True)
            except FileNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - the driver's own (botocore's EndpointConnectionError, ...)
                raise refuse(f"a reachable bucket ({type(e).__name__}: {' '.join(str(e).split())})") from None
            raise refuse(f"a URL in an existing bucket (no bucket {self.bucket!r})")

    def put(self, rel: str, data: bytes) -> None:
        """One PUT of `data` as object `rel` (atomic: readers see the old object or the new one)."""
        self.fs.pipe_file(self._p(rel), bytes(data))

    def get(self, rel: str) -> bytes:
        """The bytes of object `rel`; FileNotFoundError if it does not exist."""
        return self.fs.cat_file(self._p(rel))

    def info_id(self, rel: str):
        """An identity of object `rel` (ETag and size): a rewritten object changes it; None if missing."""
        try:
            info = self.fs.info(self._p(rel))
        except FileNotFoundError:
            return None
        return (str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or ""), int(info.get("size") or 0))

    def children(self) -> list[str]:
        """Names directly under the prefix (objects and sub-prefixes)."""
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False, refresh=True)]
        except FileNotFoundError:
            return []

    def remove(self, rel: str) -> None:
        """Deletes object or sub-prefix `rel` (everything under it); missing is fine."""
        try:
            self.fs.rm(self._p(rel), recursive=True)
        except FileNotFoundError:
            pass

    def remove_unlisted(self, pattern: re.Pattern, listed: set) -> list[str]:
        """Deletes the sub-prefixes matching `pattern` that are not in `listed`: a killed writer's garbage."""
        removed = [name for name in self.children() if pattern.match(name) and name not in listed]
        for name in removed:
            self.remove(name)
        return removed

    def acquire_lease(self, seconds: float = LEASE_SECONDS) -> str:
        """Takes the writer lease of this prefix, or raises a one-line `RunDirInUseError` naming its holder.

        The lease is an object holding an owner token, host, pid and expiry.
        It is free when missing, expired, or held by a process of this host
        that no longer runs (a killed run: its resume takes it over at once).
        A writer renews it at each save (`renew_lease`) and deletes it at the
        end. Limits: the check and the PUT are two requests, so two writers
        starting within the same few milliseconds can both pass the check;
        the read-back below catches all but the exactly simultaneous case.
        A writer on another host that dies holds the lease until it expires.
        Within one process the lease is re-entrant.

        Returns:
            The owner token, for `renew_lease`/`release_lease`.
        """
        holder = self._lease()
        if holder is not None and not _lease_free(holder):
            raise RunDirInUseError(
                f"Another writer holds {self.url} (host {holder.get('host')!r}, pid {holder.get('pid')}, lease until "
                f"{time.strftime('%H:%M:%S', time.gmtime(float(holder.get('expires', 0))))} UTC): two runs must not "
                "write one checkpoint directory; stop the other run or use another directory."
            )
        token = uuid.uuid4().hex
        self.renew_lease(token, seconds)
        if (self._lease() or {}).get("token") != token:
            raise RunDirInUseError(f"Another writer took {self.url} at the same moment; retry once it is gone.")
        return token

    def renew_lease(self, token: str, seconds: float = LEASE_SECONDS) -> None:
        """(Re)writes the lease for `token`, valid `seconds` from now."""
        body = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "expires": time.time() + seconds}
        self.put(LEASE_OBJECT, json.dumps(body).encode())

    def release_lease(self, token: str) -> None:
        """Deletes the lease if `token` still holds it."""
        if (self._lease() or {}).get("token") == token:
            self.remove(LEASE_OBJECT)

    def _lease(self) -> dict | None:
        try:
            data = json.loads(self.get(LEASE_OBJECT))
            return data if isinstance(data, dict) else None
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # a torn or foreign object: no valid holder


    def files(self, skip: tuple[str, ...] = ()) -> list[str]:
        """Every object under the prefix, as names relative to it, but those under a `skip` sub-prefix."""
        try:
            found = self.fs.find(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = [p[len(self.root) + 1:] for p in found if p.startswith(self.root + "/")]
        return sorted(n for n in names if n.split("/", 1)[0] not in skip and n != LEASE_OBJECT)


def mirror_down(url: str, local: Path, skip: tuple[str, ...] = (), seen: dict | None = None) -> int:
    """Copies every object under `url` (but the `skip` sub-prefixes) into the local directory `local`.

    With `seen`, each copied file's size and mtime go into it, as `mirror_up` keeps them, so
    the next `mirror_up` uploads only what changed after the copy.

    Returns:
        How many files were copied.

    Example:
    >>> mirror_down("s3://bucket/run", Path("/tmp/run"), skip=("checkpoints",))  # doctest: +SKIP
    3
    """
    store = store_for(url)
    names = store.files(skip)
    for name in names:
        path = Path(local, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(store.get(name))
        if seen is not None:
            st = path.stat()
            seen[name] = (st.st_size, st.st_mtime_ns)
    return len(names)


def mirror_up(local: Path, url: str, seen: dict, skip: tuple[str, ...] = ()) -> int:
    """Uploads the files of `local` that changed since the last call (size and mtime in `seen`, updated).

    One PUT per file: a reader sees each file whole, old or new. Files under a
    `skip` sub-directory are left out (a run's checkpoints go to the store
    directly, with their own commit protocol).

    Returns:
        How many files were uploaded.

    Example:
    >>> seen = {}; mirror_up(Path("/tmp/run"), "s3://bucket/run", seen)  # doctest: +SKIP
    3
    """
    store = store_for(url)
    sent = 0
    for path in sorted(Path(local).rglob("*")):
        rel = path.relative_to(local).as_posix()
        if not path.is_file() or rel.split("/", 1)[0] in skip:
            continue
        st = path.stat()
        stamp = (st.st_size, st.st_mtime_ns)
        if seen.get(rel) == stamp:
            continue
        store.put(rel, path.read_bytes())
        seen[rel] = stamp
        sent += 1
    return sent


class StagedDirectory:
    """A local copy of the objects under `url`, for code that writes only local files (KerasTuner).

    `__init__` copies the objects down into a directory named after the URL under
    the temporary directory (the same path on every rerun, so absolute paths the
    writer records stay valid on resume; emptied first, so it holds the URL's
    state and nothing a killed run left), `sync()` uploads what changed and deletes
    what was deleted, `close()` syncs and removes the copy. A writer killed between
    syncs loses what it wrote since the last one, as a local run its unsaved work.

    Args:
        url: An object-store URL (checked by `check_url`). Required.

    Example:
    >>> staged = StagedDirectory("s3://bucket/tuning/p")  # doctest: +SKIP
    >>> staged.path  # doctest: +SKIP
    PosixPath('/tmp/trainwell-staged-5f1c.../p')
    """

    def __init__(self, url: str) -> None:
        import hashlib  # here: only a staged directory names itself by a hash

        self.url = check_url(url, "url")
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.root = Path(tempfile.gettempdir(), f"trainwell-staged-{digest}")
        shutil.rmtree(self.root, ignore_errors=True)
        self.path = self.root / Path(urlsplit(self.url).path).name
        self.path.mkdir(parents=True)
        self._seen: dict = {}
        mirror_down(self.url, self.path, seen=self._seen)

    def where(self, local) -> str:
        """The URL of `local`, a path inside the copy."""
        rel = Path(local).relative_to(self.path).as_posix()
        return self.url if rel == "." else f"{self.url}/{rel}"

    def sync(self) -> int:
        """Uploads the files that changed since the last sync and deletes the objects of files
        deleted here (KerasTuner's `overwrite`, pruned checkpoints); returns how many it uploaded."""
        sent = mirror_up(self.path, self.url, self._seen)
        gone = [rel for rel in self._seen if not (self.path / rel).is_file()]
        store = store_for(self.url) if gone else None
        for rel in gone:
            store.remove(rel)
            del self._seen[rel]
        return sent

    def close(self) -> None:
        """The last upload, then the local copy goes (also when the upload fails)."""
        try:
            self.sync()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


_STORES: dict = {}


def store_for(url: str) -> ObjectStore:
    """The `ObjectStore` of `url`, made once per URL and endpoint (a driver client is slow to make).

    Example:
    >>> store_for("s3://bucket/run") is store_for("s3://bucket/run/")  # doctest: +SKIP
    True
    """
    key = (url.rstrip("/"), os.environ.get("AWS_ENDPOINT_URL"))
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = ObjectStore(url)
    return store


def _lease_free(holder: dict) -> bool:
    try:
        if time.time() > float(holder.get("expires", 0)):
            return True
    except (TypeError, ValueError):
        return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if holder["pid"] == os.getpid():
            return True  # re-entrant in one process, as `trainwell.rundir.lock_run_dir` is (a notebook's refit)
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True  # that run was killed: its lease is stale
        except PermissionError:
            return False
        return False
    return False


# ---- the local backend: the POSIX commit of a checkpoint directory (moved here from callbacks.checkpoint.files)


def write_npz(path, arrays: dict) -> None:
    """Writes `arrays` as an uncompressed `.npz` to `path` (a local file or a file object).

    Example:
    >>> import io; write_npz(io.BytesIO(), {"a": np.zeros(2)})
    """
    np.savez(path, **arrays)


def write_text(path: Path, text: str) -> None:
    """Writes `text` (UTF-8) to the local file `path`.

    Example:
    >>> import tempfile; write_text(Path(tempfile.mkdtemp()) / "a.txt", "hi")
    """
    path.write_text(text, encoding="utf-8")


def commit_directory(tmp: Path, final: Path, tmp_prefix: str) -> None:
    """Commits the directory written in `tmp` as `final`: its files and `tmp` fsynced, then one rename.

    The rename is durable once `final.parent` is fsynced (`write_json_replace`
    of the index does it, so one fsync covers both renames). A directory
    already at `final` is moved aside (into a `tmp_prefix` directory) first and
    removed once the new one is durable.

    Example:
    >>> import tempfile; d = Path(tempfile.mkdtemp()); (d / "t").mkdir()
    >>> commit_directory(d / "t", d / "final", ".tmp-"); (d / "final").is_dir()
    True
    """
    for child in tmp.iterdir():
        if child.is_dir():  # a checkpoint's sharded arrays: Orbax synced and committed them itself
            fsync_dir(child)
            continue
        with open(child, "rb+") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    directory = final.parent
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=directory)) / "old"
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        fsync_dir(directory)
        shutil.rmtree(old.parent, ignore_errors=True)


def write_json_replace(directory: Path, name: str, obj: dict) -> None:
    """Replaces `directory/name` with `obj` as JSON (a temporary, one rename), then fsyncs `directory`.

    The temporary is named as `trainwell.io`'s are (`.<name>.*.tmp`), so
    `trainwell.io.remove_stale_temporaries` removes a killed one.

    Example:
    >>> import tempfile; d = Path(tempfile.mkdtemp()); write_json_replace(d, "i.json", {"a": 1})
    >>> (d / "i.json").read_text()
    '{\\n  "a": 1\\n}'
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 would hide the index from the directory's other readers
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(directory)
