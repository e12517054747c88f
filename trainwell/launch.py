"""Local multi-worker launcher: N worker processes on 127.0.0.1, one `TF_CONFIG` each.

`trainwell train RECIPE --workers N` runs the recipe as N processes on this
machine, each a `MultiWorkerMirroredStrategy` worker with its own `TF_CONFIG`
(cluster on free loopback ports, `task.index` = 0..N-1). On Keras's JAX backend
the same workers join one `jax.distributed` job instead: every worker also gets
Keras's `KERAS_DISTRIBUTION_JOB_ADDRESSES` (the same addresses; the first is JAX's
coordinator), `KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`
(= `task.index`), which `trainwell.runtime.make_strategy("multiworker")` hands to
`keras.distribution.initialize()`, and `JAX_COORDINATOR_BIND_ADDRESS` (the
coordinator listens on 127.0.0.1 only). With `KERAS_BACKEND=jax` the workers get no
`TF_CONFIG` (tf.data would otherwise pick file sharding for a `tf.distribute` that
does not run), with `KERAS_BACKEND=tensorflow` no `KERAS_DISTRIBUTION_*`; unset
(Keras's `keras.json` decides in the worker), both, and each backend reads its own. It is meant for trying
and testing multi-worker training on one machine; on a real cluster every host
starts one worker with its own `TF_CONFIG` (see the README's "Distributed
training" section).

Network exposure. Every worker runs a TensorFlow gRPC server (collectives and the
coordination service) that takes commands from anyone who can connect, without
authentication (on JAX: worker 0 runs JAX's coordination service, and the CPU
collectives use Gloo's TCP connections, equally unauthenticated), and TensorFlow
binds it to all interfaces: `GrpcServer::Init`
listens on `"0.0.0.0:" + port` whatever host `TF_CONFIG` names, and has no option
for another bind address. So on Linux the launcher runs its workers in a private
network namespace whose only interface is loopback (`unshare --user --net`, joined
with `nsenter`; no privileges needed where unprivileged user namespaces are allowed):
the workers reach each other on 127.0.0.1 and nothing outside the namespace can
reach their ports. Inside it the workers have no other network either (no remote
data such as `gs://` paths); set `TRAINWELL_ISOLATE_WORKERS=0` (or pass
`isolate_network=False`) to run them in the machine's namespace instead, where
their ports are open on every interface. Where namespaces are unavailable (not
Linux, or user namespaces disabled) the workers run without isolation and the
launcher says so on stderr. On a real cluster the addresses come from each host's
`TF_CONFIG` and the servers listen on all of that host's interfaces: put the
workers on a private network that only they (and you) can reach.

What the launcher does:

- Picks N free TCP ports on 127.0.0.1 and starts every worker with
  `TF_CONFIG={"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}`
  and/or the `KERAS_DISTRIBUTION_*` variables of the same cluster (`worker_envs`),
  and `TRAINWELL_LAUNCHED=1` (so a worker never launches workers itself), inside
  the private network namespace (see above).
- Streams the chief's (worker 0's) stdout and stderr to its own; the other
  workers write to `worker-<i>.log` in `log_dir` (a temporary directory by
  default, removed after a successful run and kept, with its path printed, after
  a failure).
- Forwards SIGINT and SIGTERM to every worker (SIGTERM makes trainwell's
  `Checkpoint` save and exit with 143 on every worker at the same step).
- Fails fast: when a worker exits with a non-zero status, the others get
  `peer_grace_s` seconds to end on their own (a preempted job ends on every
  worker within a step), then are killed with SIGKILL.
- Kills every worker still running when it returns (also on an exception).

Exit status (`launch` returns it, the CLI exits with it):

| status | meaning |
|---|---|
| 0 | every worker exited 0 |
| 143 | preempted: every worker that ended on its own exited 0 or 143 (checkpoint written; rerun the same command or `trainwell resume RUN_DIR` to continue) |
| other | the status of the first worker that failed; a worker killed by signal S counts as 128 + S (SIGKILL: 137) |
| 124 | `timeout_s` passed before the workers ended (all were killed) |

Example:
>>> from trainwell import launch
>>> code = launch.launch([sys.executable, "train.py"], workers=2)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from trainwell.validation import invalid_argument, is_int

#: Exit status when `timeout_s` passes (as coreutils `timeout`).
EXIT_TIMEOUT = 124
#: Exit status of a preempted job (see `trainwell.callbacks.Checkpoint.PREEMPTED_EXIT_CODE`).
EXIT_PREEMPTED = 143
#: Environment variable set in every launched worker.
LAUNCHED_ENV = "TRAINWELL_LAUNCHED"
#: Environment variable: `0` runs local workers in the machine's network namespace.
ISOLATE_ENV = "TRAINWELL_ISOLATE_WORKERS"

# Runs inside the new network namespace: brings its loopback interface up (a new
# namespace starts with `lo` down), says so, and holds the namespace open until the
# launcher closes its stdin (or dies).
_NAMESPACE_HOLDER = """
import fcntl, socket, struct, sys
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
print("ready", flush=True)
sys.stdin.read()
"""


class PrivateNetwork:
    """A network namespace with only a loopback interface, for local workers (Linux).

    A small holder process is started with `unshare --user --map-root-user --net`
    (util-linux; no privileges needed where unprivileged user namespaces are allowed)
    and brings `lo` up; `prefix` is the `nsenter` command line that runs a program
    inside it. The namespace lives until `close()` (or the launcher's death closes
    the holder's stdin) and its last member exits.

    Args:
        timeout_s: Seconds to wait for the namespace to be ready. Defaults to `30.0`.

    Raises:
        OSError: namespaces are not available here; the message says why.

    Example:
    >>> with PrivateNetwork() as net:  # doctest: +SKIP
    ...     subprocess.run(net.prefix + ["python", "-c", "print('isolated')"])
    """

    def __init__(self, timeout_s: float = 30.0):
        unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
        if not sys.platform.startswith("linux") or not (unshare and nsenter):
            raise OSError("needs Linux with util-linux's `unshare` and `nsenter`")
        self._proc = subprocess.Popen(
            [unshare, "--user", "--map-root-user", "--net", "--", sys.executable, "-c", _NAMESPACE_HOLDER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            err = self._proc.stderr.read().decode("utf-8", "replace").strip().splitlines()
            raise OSError(err[-1] if err else "the namespace holder did not start")
        self.pid = self._proc.pid
        self.prefix = [nsenter, f"--target={self.pid}", "--user", "--net", "--preserve-credentials", "--"]

    def close(self) -> None:
        """Ends the holder process (the namespace goes once its workers have exited too)."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "PrivateNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Returns `n` distinct TCP ports that are free on `host` right now.

    The sockets are bound together (so the ports differ) and closed before
    returning; another process could take a port in between, which on a test
    machine is rare enough.

    Args:
        n: Number of ports, >= 1.
        host: Interface to bind. Defaults to `"127.0.0.1"`.

    Example:
    >>> len(free_ports(2))
    2
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise invalid_argument("n", "an int >= 1", n)
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_configs(workers: int, host: str = "127.0.0.1", ports: Sequence[int] | None = None) -> list[str]:
    """The `TF_CONFIG` JSON string of each of `workers` workers on `host`.

    Args:
        workers: Number of workers, >= 1.
        host: Host of every worker. Defaults to `"127.0.0.1"`.
        ports: One port per worker. Defaults to `None` (free ports).

    Example:
    >>> json.loads(tf_configs(2, ports=[1234, 1235])[1])["task"]
    {'type': 'worker', 'index': 1}
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise invalid_argument("workers", "an int >= 1", workers)
    ports = list(ports) if ports is not None else free_ports(workers, host)
    if len(ports) != workers:
        raise invalid_argument("ports", f"{workers} ports", ports)
    cluster = {"worker": [f"{host}:{p}" for p in ports]}
    return [json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}) for i in range(workers)]


def keras_distribution_envs(workers: int, host: str = "127.0.0.1",
                            ports: Sequence[int] | None = None) -> list[dict[str, str]]:
    """The `KERAS_DISTRIBUTION_*` variables of each of `workers` JAX processes on `host`.

    `keras.distribution.initialize()` reads them (the first address is JAX's
    coordinator); they describe the same cluster as `tf_configs` with the same
    `ports`, so one launcher serves both backends. `JAX_COORDINATOR_BIND_ADDRESS`
    (read by `jax.distributed.initialize`) makes the coordinator listen on `host`
    only, instead of JAX's default, every interface (`[::]:PORT`).

    Args:
        workers: Number of processes, >= 1.
        host: Host of every process. Defaults to `"127.0.0.1"`.
        ports: One port per process (only the first is used, by the coordinator).
            Defaults to `None` (free ports).

    Example:
    >>> keras_distribution_envs(2, ports=[1234, 1235])[1]["KERAS_DISTRIBUTION_PROCESS_ID"]
    '1'
    """
    configs = [json.loads(c) for c in tf_configs(workers, host, ports)]
    addresses = ",".join(configs[0]["cluster"]["worker"])
    coordinator = configs[0]["cluster"]["worker"][0]
    return [
        {"KERAS_DISTRIBUTION_JOB_ADDRESSES": addresses, "KERAS_DISTRIBUTION_NUM_PROCESSES": str(workers),
         "KERAS_DISTRIBUTION_PROCESS_ID": str(c["task"]["index"]), "JAX_COORDINATOR_BIND_ADDRESS": coordinator}
        for c in configs
    ]


def worker_envs(workers: int, backend: str | None = None, host: str = "127.0.0.1",
                ports: Sequence[int] | None = None) -> list[dict[str, str]]:
    """The cluster variables of each of `workers` local workers for Keras's `backend`.

    `TF_CONFIG` (`tf_configs`) unless `backend` is `"jax"`, the `KERAS_DISTRIBUTION_*`
    variables (`keras_distribution_envs`) unless it is `"tensorflow"`; both describe
    the same cluster.

    Args:
        workers: Number of workers, >= 1.
        backend: The workers' `KERAS_BACKEND`. Defaults to `None` (unknown: both).
        host: Host of every worker. Defaults to `"127.0.0.1"`.
        ports: One port per worker. Defaults to `None` (free ports).

    Example:
    >>> sorted(worker_envs(2, "jax", ports=[1234, 1235])[0])[1:]
    ['KERAS_DISTRIBUTION_JOB_ADDRESSES', 'KERAS_DISTRIBUTION_NUM_PROCESSES', 'KERAS_DISTRIBUTION_PROCESS_ID']
    """
    if not (is_int(workers) and workers >= 1):
        raise invalid_argument("workers", "an int >= 1", workers)
    ports = list(ports) if ports is not None else free_ports(workers, host)
    tf = [{"TF_CONFIG": c} for c in tf_configs(workers, host, ports)]
    keras = keras_distribution_envs(workers, host, ports)
    return [{**(t if backend != "jax" else {}), **(k if backend != "tensorflow" else {})} for t, k in zip(tf, keras)]


def _status(code: int | None) -> int | None:
    """A Popen return code as a shell reports it (signal S -> 128 + S)."""
    if code is None:
        return None
    return 128 - code if code < 0 else code


def _wait_into(i: int, p: subprocess.Popen, ended: "queue.Queue[tuple[int, int]]") -> None:
    """Waits for process `i` and puts `(i, status)` on `ended` as soon as it ends."""
    ended.put((i, _status(p.wait())))


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:  # pragma: no cover - already gone
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


def _terminate(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each process still running, SIGKILL to those still running `grace_s` later."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except OSError:  # pragma: no cover - already gone
                pass
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill(procs)


def supervise(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    decide: Callable[[dict[int, int], float], int | None],
    *,
    outputs: Sequence = (),
    cwd: str | os.PathLike | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.2,
    on_start: Callable[[list[subprocess.Popen]], None] | None = None,
    stop_grace_s: float = 0.0,
) -> int | None:
    # one piece: the signal forwarding, start, wait loop and cleanup share one `try` (every exit kills the children)
    """Runs processes until `decide` returns a status or `timeout_s` passes: the one process supervisor.

    Both of trainwell's multi-process runs go through here: the workers of a
    multi-worker training job (`launch`) and KerasTuner's chief and workers of a
    distributed search (`launch_distributed`); only their `decide` differs. Each
    process gets its own session (a Ctrl-C in the terminal is forwarded once, not
    delivered twice); SIGINT and SIGTERM sent to this process are forwarded to every
    child (from the main thread only). One waiter thread per process records the
    order in which they end: when one is killed and a peer fails because of it a few
    milliseconds later, polling both would see them end together and could blame the
    peer. Every child still running when this returns is stopped (also on an
    exception): SIGTERM and `stop_grace_s` seconds, then SIGKILL.

    Args:
        commands: The command line of each process.
        envs: The whole environment of each process.
        decide: `decide(ended, elapsed_s) -> status or None`, called after each end
            and every `poll_s`; `ended` maps a process's index to its exit status
            (128 + S for a signal S), in the order they ended. A status ends the run.
        outputs: Per process, a binary file for its stdout and stderr, or `None` to
            inherit this process's. Defaults to `()` (all inherit).
        cwd: Working directory. Defaults to `None` (this one).
        timeout_s: Seconds after which everything is stopped and `None` is
            returned. Defaults to `None` (no limit).
        poll_s: Longest wait between calls of `decide`. Defaults to `0.2`.
        on_start: Called with the `Popen`s once all are started. Defaults to `None`.
        stop_grace_s: Seconds between SIGTERM and SIGKILL when stopping. Defaults
            to `0.0` (SIGKILL at once).

    Returns:
        `decide`'s status, or `None` when `timeout_s` passed.

    Example:
    >>> supervise([[sys.executable, "-c", "pass"]] * 2, [dict(os.environ)] * 2,
    ...           lambda ended, t: 0 if len(ended) == 2 else None)
    0
    """
    procs: list[subprocess.Popen] = []
    received: list[int] = []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except OSError:  # pragma: no cover
                    pass

    try:
        if main_thread:
            for s in (signal.SIGINT, signal.SIGTERM):
                previous[s] = signal.signal(s, forward)
        for i, (command, env) in enumerate(zip(commands, envs)):
            out = outputs[i] if i < len(outputs) else None
            procs.append(subprocess.Popen(list(command), env=dict(env), cwd=cwd, stdout=out,
                                          stderr=subprocess.STDOUT if out is not None else None,
                                          start_new_session=True))
        ended: queue.Queue[tuple[int, int]] = queue.Queue()
        for i, p in enumerate(procs):
            threading.Thread(target=_wait_into, args=(i, p, ended), daemon=True,
                             name=f"trainwell-supervise-wait-{i}").start()
        if on_start is not None:
            on_start(list(procs))
        t0 = time.monotonic()
        done: dict[int, int] = {}
        while True:
            try:
                done.update([ended.get(timeout=poll_s)])
                while True:
                    done.update([ended.get_nowait()])  # in the order they ended
            except queue.Empty:
                pass
            elapsed = time.monotonic() - t0
            status = decide(dict(done), elapsed)
            if status is not None:
                return status
            if timeout_s is not None and elapsed > timeout_s:
                return None
    finally:
        _terminate(procs, stop_grace_s) if stop_grace_s else _kill(procs)
        if main_thread:
            for s, h in previous.items():
                signal.signal(s, h)


def _private_network(isolate_network: bool | None) -> PrivateNetwork | None:
    """`launch`'s `isolate_network`: the namespace, or `None` (off, or unavailable and not required: a warning)."""
    required = isolate_network is True
    if isolate_network is None:
        isolate_network = os.environ.get(ISOLATE_ENV, "1").strip() != "0"
    if not isolate_network:
        return None
    try:
        return PrivateNetwork()
    except OSError as e:
        if required:
            raise
        print(
            f"trainwell launch: cannot isolate the workers' network ({e}); their gRPC ports (TensorFlow's "
            "servers, JAX's coordinator) listen on every interface of this machine, without authentication.",
            file=sys.stderr,
        )
        return None


def _report_failure(first_failure: tuple[int, int, float], status: int, logs: Path, workers: int) -> None:
    """The failed job's line on stderr: the first worker that failed, then the other workers' last log lines."""
    i, c, _ = first_failure
    print(f"trainwell launch: worker {i} exited with status {c}; job status {status}. Worker logs: {logs}",
          file=sys.stderr)
    for j in range(1, workers):
        path = logs / f"worker-{j}.log"
        if path.is_file():
            tail = path.read_bytes()[-2000:].decode("utf-8", "replace")
            print(f"--- worker {j} (last lines) ---\n{tail}", file=sys.stderr)


def launch(  # one piece: 12 documented arguments; checks, workers started, supervised, reported
    command: Sequence[str],
    workers: int,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    peer_grace_s: float = 20.0,
    timeout_s: float | None = None,
    log_dir: str | os.PathLike | None = None,
    stream_chief: bool = True,
    poll_s: float = 0.2,
    on_start: Callable[[list[subprocess.Popen]], None] | None = None,
    isolate_network: bool | None = None,
) -> int:
    """Runs `command` as `workers` local worker processes and returns the job's exit status.

    Args:
        command: The command each worker runs, e.g.
            `[sys.executable, "-m", "trainwell.cli", "train", "resnet-imagenet", ...]`.
            It must make a multi-worker strategy from `TF_CONFIG` (TensorFlow) or
            the `KERAS_DISTRIBUTION_*` variables (JAX):
            `trainwell.runtime.make_strategy("multiworker")` does either.
        workers: Number of worker processes, >= 1.
        env: Extra environment variables for every worker. Defaults to `None`.
        cwd: Working directory of the workers. Defaults to `None` (this one).
        peer_grace_s: Seconds the other workers get to end on their own after one
            failed, before they are killed. Defaults to `20.0`.
        timeout_s: Kill everything and return 124 after this many seconds;
            `None` waits as long as the workers run. Defaults to `None`.
        log_dir: Directory for the logs of workers 1..N-1 (and worker 0 when
            `stream_chief=False`). Defaults to `None` (a temporary directory,
            removed after a successful run).
        stream_chief: Pass worker 0's output through to this process's stdout and
            stderr. Defaults to `True`.
        poll_s: Longest wait, in seconds, between checks of the grace period and
            the timeout (a worker's end is seen at once). Defaults to `0.2`.
        on_start: Called with the list of worker `Popen`s (index = task index)
            once all are started, e.g. to watch or signal one worker. Defaults to
            `None`.
        isolate_network: Run the workers in a private network namespace with only
            loopback (`PrivateNetwork`), so their unauthenticated gRPC ports cannot be
            reached from outside. `True` requires it, `False` turns it off, `None`
            uses it where available (else a warning on stderr) unless the
            environment sets `TRAINWELL_ISOLATE_WORKERS=0`. Defaults to `None`.

    Returns:
        The job's exit status; see the module docstring.

    Example:
    >>> launch([sys.executable, "-c", "print('hi')"], workers=2)  # doctest: +SKIP
    hi
    0
    """
    if not command or isinstance(command, str):
        raise invalid_argument("command", "a non-empty list of strings", command)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise invalid_argument("workers", "an int >= 1", workers)
    if not (isinstance(peer_grace_s, (int, float)) and peer_grace_s >= 0):
        raise invalid_argument("peer_grace_s", "a number >= 0", peer_grace_s)
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise invalid_argument("timeout_s", "None or a number > 0", timeout_s)
    network = _private_network(isolate_network)
    prefix = network.prefix if network is not None else []
    own_logs = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="trainwell-workers-")) if own_logs else Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, **(env or {}), LAUNCHED_ENV: "1"}
    files = [None if (i == 0 and stream_chief) else open(logs / f"worker-{i}.log", "wb") for i in range(workers)]
    first_failure: list[tuple[int, int, float]] = []  # (worker, status, when)

    def decide(ended: dict[int, int], elapsed: float) -> int | None:
        for i, c in ended.items():  # in the order the workers ended
            if c != 0 and not first_failure:
                first_failure.append((i, c, elapsed))
        if len(ended) == workers or (first_failure and elapsed - first_failure[0][2] > peer_grace_s):
            if not first_failure:
                return 0
            codes = [ended.get(i) for i in range(workers)]
            if first_failure[0][1] == EXIT_PREEMPTED and all(c in (0, EXIT_PREEMPTED) for c in codes):
                return EXIT_PREEMPTED
            return first_failure[0][1]
        return None

    status = None
    try:
        backend = base_env.get("KERAS_BACKEND", "").strip().lower() or None
        envs = [{**base_env, **w} for w in worker_envs(workers, backend)]
        status = supervise(
            [prefix + list(command)] * workers, envs, decide,
            outputs=files, cwd=cwd, timeout_s=timeout_s, poll_s=poll_s, on_start=on_start,
        )
        if status is None:
            status = EXIT_TIMEOUT
        return status
    finally:
        if network is not None:
            network.close()
        for f in files:
            if f is not None:
                f.close()
        if status not in (0, None) and first_failure:
            _report_failure(first_failure[0], status, logs, workers)
        elif own_logs:
            shutil.rmtree(logs, ignore_errors=True)


def worker_command(argv: Sequence[str], strategy: str = "multiworker") -> list[str]:
    """The command a launched worker runs for the `trainwell` arguments `argv`.

    `--workers N` is dropped (a worker never launches) and `--set strategy=STRATEGY`
    is appended: `"multiworker"` (data parallel over every process), or the run's own
    `"model_parallel:DxM"`, whose mesh spans every process's devices (JAX).

    Example:
    >>> worker_command(["train", "resnet-imagenet", "--workers", "2"])[-4:]
    ['train', 'resnet-imagenet', '--set', 'strategy=multiworker']
    """
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--workers":
            skip = True
            continue
        if a.startswith("--workers="):
            continue
        out.append(a)
    return [sys.executable, "-m", "trainwell.cli", *out, "--set", f"strategy={strategy}"]


def launch_distributed(
    argv: Sequence[str], workers: int, *, host: str = "127.0.0.1", port: int | None = None,
    timeout_s: float | None = None, env=None, chief_grace_s: float = 60.0, log_dir=None,
) -> int:
    # one piece: a 31-line docstring; the body starts the chief, then the workers, and waits for both
    """Runs a search as KerasTuner's chief oracle plus `workers` worker processes.

    Each process runs `python -m trainwell.cli <argv>` with KerasTuner's
    environment variables: `KERASTUNER_TUNER_ID` (`chief`, `tuner0`, ...),
    `KERASTUNER_ORACLE_IP` and `KERASTUNER_ORACLE_PORT`. The chief serves the
    oracle over gRPC **without authentication or TLS**: anyone who can reach the
    port can read the trials and submit results, so the default host is
    127.0.0.1. Waits are bounded: a worker that fails, the chief exiting, the
    overall `timeout_s`, or the chief still running `chief_grace_s` after the last
    worker finished stops everything; every child is terminated (SIGTERM, then
    SIGKILL) before this returns.

    Args:
        argv: Command-line arguments of `trainwell` for each process (without `--workers`).
        workers: Number of worker processes (>= 1).
        host: Address the chief listens on. Defaults to `"127.0.0.1"`.
        port: Its port. Defaults to `None` (a free port).
        timeout_s: Overall limit in seconds. Defaults to `None` (no limit).
        env: Base environment. Defaults to `None` (`os.environ`).
        chief_grace_s: Seconds the chief may take to finish after the workers.
            Defaults to `60.0`.
        log_dir: Directory for each process's output (`chief.log`, `tuner0.log`, ...);
            `None` lets them write to this process's stdout/stderr. Defaults to `None`.

    Returns:
        The exit status: the chief's, or 1 when a worker failed or time ran out.

    Example:
    >>> launch_distributed(["tune", "resnet-imagenet", "--tuner", "random"], workers=2)  # doctest: +SKIP
    0
    """
    if not (is_int(workers) and workers >= 1):
        raise invalid_argument("workers", "an int >= 1", workers)
    port = int(port or free_ports(1, host)[0])
    base = dict(os.environ if env is None else env)
    base.update({"KERASTUNER_ORACLE_IP": host, "KERASTUNER_ORACLE_PORT": str(port)})
    names = ["chief"] + [f"tuner{i}" for i in range(workers)]
    files = []
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        files = [open(Path(log_dir) / f"{name}.log", "ab") for name in names]
    chief_done_at: list[float] = []
    workers_done_at: list[float] = []

    def decide(ended: dict[int, int], elapsed: float) -> int | None:
        bad = {names[i]: c for i, c in ended.items() if i and c != 0}
        if bad:
            print(f"trainwell tune: worker(s) failed: {bad}; stopping the search.", file=sys.stderr)
            return 1
        if 0 in ended:
            if ended[0] != 0:
                print(f"trainwell tune: the chief exited with status {ended[0]}.", file=sys.stderr)
                return ended[0]
            # The chief ends once every worker was told to stop: let them exit.
            chief_done_at[:] = chief_done_at or [elapsed]
            if len(ended) == len(names):
                return 0
            if elapsed - chief_done_at[0] > chief_grace_s:
                print("trainwell tune: worker(s) still running after the search ended; stopping them.",
                      file=sys.stderr)
                return 0
            return None
        if len(ended) == workers:  # every worker done (all 0), the chief still running
            workers_done_at[:] = workers_done_at or [elapsed]
            if elapsed - workers_done_at[0] > chief_grace_s:
                print("trainwell tune: the chief did not finish after its workers; stopping it.", file=sys.stderr)
                return 1
        return None

    try:
        status = supervise(
            [[sys.executable, "-m", "trainwell.cli", *argv]] * len(names),
            [dict(base, KERASTUNER_TUNER_ID=name) for name in names], decide,
            outputs=files, timeout_s=timeout_s, stop_grace_s=10.0,
        )
    finally:
        for f in files:
            f.close()
    if status is None:
        print(f"trainwell tune: the distributed search ran past {timeout_s} s; stopping it.", file=sys.stderr)
        return 1
    return status
