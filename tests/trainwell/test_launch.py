"""Tests of trainwell.launch (local workers on 127.0.0.1) and `trainwell train --workers N`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from trainwell import launch

PY = sys.executable


def _py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def test_free_ports_and_tf_configs():
    ports = launch.free_ports(3)
    assert len(set(ports)) == 3
    cfgs = [json.loads(c) for c in launch.tf_configs(2, ports=[1111, 2222])]
    assert cfgs[0]["cluster"] == {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}
    assert [c["task"] for c in cfgs] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    with pytest.raises(ValueError, match="Received: workers=0"):
        launch.tf_configs(0)
    with pytest.raises(ValueError, match=r"Received: ports=\[1\]"):
        launch.tf_configs(2, ports=[1])
    with pytest.raises(ValueError, match="Received: n=-1"):
        launch.free_ports(-1)


def test_worker_command_drops_workers_and_sets_strategy():
    cmd = launch.worker_command(["train", "resnet-imagenet", "--workers", "2", "--set", "epochs=1", "--workers=3"])
    assert cmd[:3] == [PY, "-m", "trainwell.cli"]
    assert cmd[3:] == ["train", "resnet-imagenet", "--set", "epochs=1", "--set", "strategy=multiworker"]
    # a model-parallel run keeps its mesh (over every worker's devices): not replaced by data parallelism
    cmd = launch.worker_command(["train", "causal-lm", "--workers", "2"], "model_parallel:2x4")
    assert cmd[3:] == ["train", "causal-lm", "--set", "strategy=model_parallel:2x4"]


def test_launch_validates_arguments():
    with pytest.raises(ValueError, match="Received: command='x'"):
        launch.launch("x", 2)
    with pytest.raises(ValueError, match="Received: workers=0"):
        launch.launch([PY], 0)
    with pytest.raises(ValueError, match="Received: peer_grace_s=-1"):
        launch.launch([PY], 1, peer_grace_s=-1)


def test_every_worker_gets_its_tf_config_and_success_is_0(tmp_path, capfd):
    code = launch.launch(_py(f"""
        import json, os
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        open(os.path.join({str(tmp_path)!r}, f"w{{task}}"), "w").write(os.environ["TF_CONFIG"] + "|" + os.environ["{launch.LAUNCHED_ENV}"])
        print("hello from", task)
    """), 3, timeout_s=60)
    assert code == 0
    cfgs = [json.loads((tmp_path / f"w{i}").read_text().split("|")[0]) for i in range(3)]
    assert all((tmp_path / f"w{i}").read_text().endswith("|1") for i in range(3))
    assert len({tuple(c["cluster"]["worker"]) for c in cfgs}) == 1 and [c["task"]["index"] for c in cfgs] == [0, 1, 2]
    assert all(h.startswith("127.0.0.1:") for h in cfgs[0]["cluster"]["worker"])
    out = capfd.readouterr().out
    assert "hello from 0" in out and "hello from 1" not in out  # only the chief's output is streamed


def test_a_failing_worker_makes_the_job_fail_fast_and_kills_the_others(tmp_path):
    procs = []
    t0 = time.monotonic()
    code = launch.launch(_py("""
        import json, os, sys, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if task == 1:
            print("worker 1 gives up", flush=True)
            sys.exit(5)
        time.sleep(120)
    """), 2, peer_grace_s=1.0, timeout_s=100, log_dir=tmp_path, on_start=procs.extend)
    assert code == 5
    assert time.monotonic() - t0 < 30
    assert procs[0].returncode == -signal.SIGKILL  # killed after the grace period
    assert "worker 1 gives up" in (tmp_path / "worker-1.log").read_text()


def test_a_worker_killed_by_a_signal_reports_128_plus_signal():
    code = launch.launch(_py("""
        import json, os, signal, time
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    """), 2, peer_grace_s=0.5, timeout_s=100)
    assert code == 137


def test_the_first_worker_to_end_is_blamed_even_when_a_peer_fails_right_after(tmp_path):
    # Worker 1 is killed; worker 0 notices and fails 30 ms later (as a TF worker does
    # when its peer's socket closes). Both end within one poll, so checking the
    # workers in index order would report worker 0's status 3 instead of 137.
    code = launch.launch(_py(f"""
        import json, os, signal, sys, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        flag = os.path.join({str(tmp_path)!r}, "killed")
        if task == 1:
            time.sleep(1.0)
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        while not os.path.exists(flag):
            time.sleep(0.001)
        time.sleep(0.03)
        sys.exit(3)
    """), 2, peer_grace_s=5, timeout_s=60, poll_s=10.0)
    assert code == 137


def test_timeout_kills_everything_and_returns_124():
    procs = []
    code = launch.launch(_py("import time; time.sleep(120)"), 2, timeout_s=1.5, on_start=procs.extend)
    assert code == launch.EXIT_TIMEOUT
    assert all(p.poll() is not None for p in procs)


def test_sigterm_is_forwarded_and_a_preempted_job_exits_143(tmp_path):
    # The launcher runs in its own process (its signal handlers need the main thread).
    worker = textwrap.dedent(f"""
        import json, os, signal, sys, time
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        def on_term(*_):
            open(os.path.join({str(tmp_path)!r}, f"term{{task}}"), "w").close()
            sys.exit(143)  # what trainwell's Checkpoint does after its checkpoint
        signal.signal(signal.SIGTERM, on_term)
        open(os.path.join({str(tmp_path)!r}, f"ready{{task}}"), "w").close()
        time.sleep(120)
    """)
    runner = _py(f"""
        import sys
        from trainwell import launch
        sys.exit(launch.launch([sys.executable, "-c", {worker!r}], 2, timeout_s=100))
    """)
    p = subprocess.Popen(runner)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 143
        assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _listening(net_dir: str) -> set[tuple[str, int]]:
    """`(address, port)` of the TCP sockets in LISTEN state in `/proc/.../net/tcp{,6}`."""
    out = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = open(os.path.join(net_dir, name)).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                addr, port = local.split(":")
                out.add((addr, int(port, 16)))
    return out


def _interfaces(pid: int) -> set[str]:
    return {line.split(":")[0].strip() for line in open(f"/proc/{pid}/net/dev").read().splitlines()[2:]}


def _isolation_available() -> bool:
    try:
        launch.PrivateNetwork().close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _isolation_available(), reason="no network namespaces here (not Linux / user namespaces off)")
def test_local_workers_listen_only_inside_a_private_loopback_network(tmp_path):
    # Worker 0 listens as TensorFlow's gRPC server does (on 0.0.0.0:PORT, PORT from TF_CONFIG);
    # worker 1 reaches it over 127.0.0.1. From outside the workers' network the port must not
    # be open: not in this (the machine's) namespace's socket table, not connectable.
    ready, checked = tmp_path / "ready", tmp_path / "checked"
    seen = {}

    def check(procs):
        def run():
            try:
                deadline = time.monotonic() + 60
                while not ready.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                port = int(ready.read_text())
                seen["worker 0 listens on"] = {a for a, p in _listening(f"/proc/{procs[0].pid}/net") if p == port}
                seen["worker 0 interfaces"] = _interfaces(procs[0].pid)
                seen["here"] = {a for a, p in _listening("/proc/self/net") if p == port}
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=5).close()
                    seen["connect from here"] = "connected"
                except OSError as e:
                    seen["connect from here"] = type(e).__name__
            finally:
                checked.touch()

        threading.Thread(target=run, daemon=True).start()

    code = launch.launch(_py(f"""
        import json, os, socket, time
        cfg = json.loads(os.environ["TF_CONFIG"])
        port = int(cfg["cluster"]["worker"][0].rsplit(":", 1)[1])
        if cfg["task"]["index"] == 0:
            s = socket.socket(); s.bind(("0.0.0.0", port)); s.listen()
            open({str(ready)!r} + ".tmp", "w").write(str(port)); os.rename({str(ready)!r} + ".tmp", {str(ready)!r})
            s.accept()
            while not os.path.exists({str(checked)!r}):
                time.sleep(0.05)
        else:
            while not os.path.exists({str(checked)!r}):
                time.sleep(0.05)
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
    """), 2, timeout_s=90, on_start=check, isolate_network=True)
    assert code == 0  # worker 1 reached worker 0 over loopback
    assert seen == {
        "worker 0 listens on": {"00000000"},  # 0.0.0.0 ...
        "worker 0 interfaces": {"lo"},  # ... of a network whose only interface is loopback
        "here": set(),
        "connect from here": "ConnectionRefusedError",
    }


def test_cli_rejects_a_bad_worker_count():
    trainwell = str(Path(PY).with_name("trainwell"))
    r = subprocess.run([trainwell, "train", "resnet-imagenet", "--workers", "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--workers: expected an integer >= 1. Received: '0'" in r.stderr and "Traceback" not in r.stderr


# Imported by every worker (PYTHONPATH): the chief lives 15 s past its last line (an exit
# handler, after the end-of-run barrier, while the coordination service it hosts still runs),
# longer than TensorFlow's 10 s heartbeat timeout, so a worker that leaves before the chief's
# process has ended is always taken for a crashed one ("The tasks have crashed").
_SLOW_CHIEF = """
import atexit, json, os, time
if json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index") == 0:
    atexit.register(time.sleep, 15)
"""


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _worker_ports(pid: int) -> dict[int, int]:
    """`{worker pid: its TF_CONFIG port}` of the launched workers under process `pid`."""
    out = {}
    for child in _children(pid):
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{child}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if "TF_CONFIG" in env:
            cfg = json.loads(env["TF_CONFIG"])
            out[child] = int(cfg["cluster"]["worker"][cfg["task"]["index"]].rsplit(":", 1)[1])
    return out


@pytest.mark.slow
@pytest.mark.serial
def test_cli_train_with_two_workers(tmp_path):
    # One run, three checks: it trains; the workers' gRPC servers cannot be reached from this
    # machine's network (observed in /proc while they run); the output has no TensorFlow
    # start-up noise and no "The tasks have crashed" (the chief is made slow to exit, see _SLOW_CHIEF).
    trainwell = str(Path(PY).with_name("trainwell"))
    sets = ["dataset=digits", "image_size=8", "model=resnet18", "width=4", "epochs=1", "batch_size=64",
            "warmup_epochs=0", "verbose=0", "doctor=false"]
    cmd = [trainwell, "train", "resnet-imagenet", "--workers", "2"] + [a for s in sets for a in ("--set", s)]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SLOW_CHIEF)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TRAINWELL_TF_LOGS")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path / "site"))
    isolated = _isolation_available()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    listening = {}  # worker pid -> addresses it listens on, in its own network
    try:
        while p.poll() is None and len(listening) < 2:
            for pid, port in _worker_ports(p.pid).items():
                addrs = {a for a, q in _listening(f"/proc/{pid}/net") if q == port}
                if addrs:
                    listening[pid] = (addrs, _interfaces(pid), {a for a, q in _listening("/proc/self/net") if q == port})
            time.sleep(0.2)
        # The limit only catches a hang: under load the training, the chief's 15 s, its interpreter exit
        # (up to a minute on a tf.data iterator's autotune thread) and the worker's own exit add up to minutes.
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert "Run finished." in out and out.count("Run finished.") == 1  # the chief's output only
    assert len(listening) == 2
    for addrs, interfaces, here in listening.values():
        assert addrs  # TF binds every interface (0.0.0.0 / ::) ...
        if isolated:
            assert interfaces == {"lo"} and here == set()  # ... of a network with only loopback, not ours
    assert "The tasks have crashed" not in err and "unhealthy" not in err, err[-3000:]
    assert "cuInit" not in err and "absl::InitializeLog" not in err, err[-3000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())  # one shared run directory
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["strategy"] in ("MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy")
    assert manifest["num_replicas"] == 2
    assert Path(manifest["config"]["run_dir"]).name == run_dir.name
    assert (run_dir / "metrics.json").is_file()


# --------------------------------------------------------------------------- runtime helpers for multi-worker


def test_collective_timeout_from_the_environment(monkeypatch):
    from trainwell import runtime

    monkeypatch.delenv(runtime.COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert runtime.collective_timeout_s() is runtime.DEFAULT_COLLECTIVE_TIMEOUT_S is None
    monkeypatch.setenv(runtime.COLLECTIVE_TIMEOUT_ENV, "0")
    assert runtime.collective_timeout_s() is None
    monkeypatch.setenv(runtime.COLLECTIVE_TIMEOUT_ENV, "12.5")
    assert runtime.collective_timeout_s() == 12.5
    monkeypatch.setenv(runtime.COLLECTIVE_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="Received: TRAINWELL_COLLECTIVE_TIMEOUT_S='soon'"):
        runtime.collective_timeout_s()


def test_shared_run_dir_single_process(tmp_path):
    from trainwell import rundir, runtime

    assert rundir.shared_run_dir(tmp_path / "given") == tmp_path / "given"
    made = rundir.shared_run_dir(None, None, prefix="x", root=str(tmp_path))
    assert made.parent == tmp_path and made.name.startswith("x-") and made.is_dir()
    assert runtime.any_across_workers(None, [True, False]) == [True, False]
    assert runtime.num_workers(None) == 1


def test_any_across_workers_ors_the_replicas_flags(python_subprocess):
    # Two replicas (cpu:2) that disagree: the reduction gives every replica the OR.
    r = python_subprocess("""
        from trainwell import runtime
        s = runtime.make_strategy("cpu:2")
        print(runtime.any_across_workers(s, [False, False, True], flags_fn=lambda rid: [rid == 1, False, rid == 0]))
        print(runtime.any_across_workers(s, [False, True]))  # one worker: this process's flags, no collective
        print(runtime.num_workers(s))
        print(runtime.broadcast_from_chief(s, [20261201235959, -3]))  # replica 0's values (one all-reduce)
    """, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-5:-1] == ["[True, False, True]", "[False, True]", "1", "[20261201235959, -3]"]


def test_worker_envs_per_backend():
    # TensorFlow reads TF_CONFIG, JAX (keras.distribution.initialize) the KERAS_DISTRIBUTION_* variables;
    # the two describe one cluster, and a worker whose backend is known gets only its own.
    both = launch.worker_envs(2, ports=[1111, 2222])
    assert [json.loads(e["TF_CONFIG"])["task"]["index"] for e in both] == [0, 1]
    assert [e["KERAS_DISTRIBUTION_PROCESS_ID"] for e in both] == ["0", "1"]
    assert {e["KERAS_DISTRIBUTION_JOB_ADDRESSES"] for e in both} == {"127.0.0.1:1111,127.0.0.1:2222"}
    assert {e["KERAS_DISTRIBUTION_NUM_PROCESSES"] for e in both} == {"2"}
    assert {e["JAX_COORDINATOR_BIND_ADDRESS"] for e in both} == {"127.0.0.1:1111"}  # not JAX's default [::]
    assert all("TF_CONFIG" not in e for e in launch.worker_envs(2, "jax", ports=[1111, 2222]))
    assert all(set(e) == {"TF_CONFIG"} for e in launch.worker_envs(2, "tensorflow", ports=[1111, 2222]))
    with pytest.raises(ValueError, match="Received: workers=0"):
        launch.worker_envs(0)
