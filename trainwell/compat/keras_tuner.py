"""KerasTuner's private names and trainwell's fixes of KerasTuner: the one place for them.

Every `keras_tuner.src` name trainwell needs is imported here and nowhere else, and
every patch of KerasTuner is applied here, gated on the KerasTuner version it was
written for (`KERAS_TUNER_FIXED_IN`), with a test that fails when KerasTuner changes
(tests/trainwell/tuning/test_tuning.py: the kill-during-save and reload tests; tests/trainwell/compat/test_keras_tuner.py: the oracle accessors). What is patched
or reached into, and why:

- `save_json` (`atomic_keras_tuner_saves`): KerasTuner 1.4 writes its state files in
  place; a kill during a save leaves a torn file the next run cannot reload.
- `Oracle.reload` (`recover_interrupted_trials`, `reconcile_reloaded_trials`): reloading
  after a kill between KerasTuner's two commits loses or reruns a trial; the fix reads
  and repairs the oracle's private retry queue.
- the chief oracle's gRPC service (`serve_chief`): KerasTuner's own polls every 20 s.
- whether this process is KerasTuner's chief or a worker (`is_chief_oracle`,
  `has_chief_oracle`): KerasTuner exposes it only under `keras_tuner.src`.
- an oracle's sampler of unseen values and its seed counter (`oracle_random_values`,
  `next_oracle_seed`): PBT's oracle samples its first generation and its explore steps
  the way KerasTuner's own oracles do, and KerasTuner keeps both private.

Example:
>>> has_chief_oracle()  # no KERASTUNER_* variables set: not a distributed search
False
"""

from __future__ import annotations

import json
import os
import time
from concurrent import futures

import keras_tuner
from keras_tuner.src import protos
from keras_tuner.src import utils as kt_utils
from keras_tuner.src.distribute import utils as dist_utils
from keras_tuner.src.distribute.oracle_chief import OracleServicer, exit_chief
from keras_tuner.src.engine import oracle as oracle_module
from keras_tuner.src.engine.trial import TrialStatus

from trainwell.compat.versions import UpstreamChanged
from trainwell.io import atomic_write_text


def is_chief_oracle() -> bool:
    """Whether this process is the chief (the oracle server) of KerasTuner's distributed mode.

    Example:
    >>> is_chief_oracle()
    False
    """
    return bool(dist_utils.is_chief_oracle())


def has_chief_oracle() -> bool:
    """Whether this process takes part in KerasTuner's distributed mode (chief or worker).

    Example:
    >>> has_chief_oracle()
    False
    """
    return bool(dist_utils.has_chief_oracle())


def _oracle_private(oracle, attr: str):
    try:
        return getattr(oracle, attr)
    except AttributeError:
        raise UpstreamChanged(
            f"trainwell needs KerasTuner's private `Oracle.{attr}`, which keras-tuner {keras_tuner.__version__} "
            "does not have; trainwell is tested with keras-tuner 1.4. Install it, or update `trainwell.compat.keras_tuner`."
        ) from None


def oracle_random_values(oracle) -> dict | None:
    """Values for every active hyperparameter not tried before (`Oracle._random_values`), or `None`.

    KerasTuner's own sampler: it keeps the oracle's seed sequence and its record of the
    values tried, so a subclass samples exactly as `RandomSearchOracle` does.

    Example:
    >>> hp = keras_tuner.HyperParameters()
    >>> _ = hp.Int("units", 1, 4)
    >>> oracle = keras_tuner.oracles.RandomSearchOracle(objective="loss", hyperparameters=hp, seed=0)
    >>> sorted(oracle_random_values(oracle))
    ['units']
    """
    return _oracle_private(oracle, "_random_values")()


def next_oracle_seed(oracle) -> int:
    """The oracle's seed counter (`Oracle._seed_state`), then advances it by one, as KerasTuner's samplers do.

    Example:
    >>> oracle = keras_tuner.oracles.RandomSearchOracle(objective="loss", seed=3)
    >>> next_oracle_seed(oracle) + 1 == next_oracle_seed(oracle)
    True
    """
    state = int(_oracle_private(oracle, "_seed_state"))
    oracle._seed_state = state + 1
    return state


#: The KerasTuner version from which trainwell's fixes of its saves and reload are no
#: longer applied (they were written against 1.4).
KERAS_TUNER_FIXED_IN = (1, 5)


def _keras_tuner_needs_fixes() -> bool:
    major, minor = (int(x) for x in keras_tuner.__version__.split(".")[:2])
    return (major, minor) < KERAS_TUNER_FIXED_IN


_ATOMIC_SAVES = {"applied": False}


def atomic_keras_tuner_saves() -> bool:
    """Makes KerasTuner write its state files atomically (a fix for KerasTuner 1.4).

    KerasTuner 1.4 saves `oracle.json`, every `trial.json` and the tuner's file
    with `open(path, "w").write(...)`: a search killed during a save (SIGKILL,
    preemption, power loss) leaves an empty or torn file, and rerunning the search
    then fails in `Oracle.reload` with a `JSONDecodeError` instead of continuing.
    This replaces `keras_tuner.src.utils.save_json`, through which all of them go,
    with a write to a temporary file, fsync and rename (`trainwell.io`), for local
    paths; other paths (`gs://`) keep KerasTuner's write. Applied by `make_tuner`;
    gated on KerasTuner < 1.5. Returns whether the fix is in place.

    Example:
    >>> atomic_keras_tuner_saves()  # doctest: +SKIP
    True
    """
    if _ATOMIC_SAVES["applied"]:
        return True
    if not _keras_tuner_needs_fixes():
        return False
    original = kt_utils.save_json

    def save_json(path, obj):
        if "://" in str(path):
            return original(path, obj)
        obj_str = json.dumps(obj)
        atomic_write_text(path, obj_str)
        return obj_str

    save_json.__doc__ = original.__doc__
    kt_utils.save_json = save_json
    _ATOMIC_SAVES["applied"] = True
    return True


_RELOAD_FIX = {"applied": False}


def reconcile_reloaded_trials(oracle) -> dict:
    """Puts a reloaded oracle's trial bookkeeping in line with its trial files.

    KerasTuner 1.4 commits a trial's start and end in two files, one after the
    other: `create_trial` writes `trial_N/trial.json` (RUNNING) and then
    `oracle.json`; `end_trial` writes `trial.json` (COMPLETED) and then an
    `oracle.json` that still lists the trial as ongoing (it is removed from
    `ongoing_trials` after the save). `Oracle.reload` takes `oracle.json` as the
    truth, so a search killed between the two writes reloads wrongly:

    - killed after a trial's start: the trial is RUNNING on disk but in no queue.
      It is never run again and never ends; random search finishes one trial
      short with a RUNNING trial left, and PBT waits forever for that member.
    - killed after a trial's end: the COMPLETED trial is listed as ongoing and
      `reload` sends it for retry, so it runs a second time.

    This runs after `Oracle.reload` (see `recover_interrupted_trials`): trials that
    are RUNNING on disk are queued for retry (their values recorded as tried, so
    the oracle does not hand them out again), and trials that already ended
    (COMPLETED, FAILED) are taken off the retry queue. INVALID trials waiting for
    their retry stay. Returns `{"requeued": [...], "dropped": [...]}`.

    Example:
    >>> reconcile_reloaded_trials(tuner.oracle)  # doctest: +SKIP
    {'requeued': ['02'], 'dropped': []}
    """
    ended = {TrialStatus.COMPLETED, TrialStatus.FAILED}
    dropped = [tid for tid in oracle._retry_queue if oracle.trials[tid].status in ended]
    oracle._retry_queue = [tid for tid in oracle._retry_queue if tid not in dropped]
    waiting = set(oracle._retry_queue) | {t.trial_id for t in oracle.ongoing_trials.values()}
    requeued = []
    for tid in sorted(oracle.trials):  # trial ids are zero-padded creation numbers
        trial = oracle.trials[tid]
        if trial.status == TrialStatus.RUNNING and tid not in waiting:
            oracle._record_values(trial)
            if tid not in oracle.start_order:
                oracle.start_order.append(tid)
            # `create_trial` pops the queue from its end: these run after the trials
            # KerasTuner queued itself, oldest first.
            oracle._retry_queue.insert(0, tid)
            requeued.append(tid)
    return {"requeued": requeued, "dropped": dropped}


def recover_interrupted_trials() -> bool:
    """Makes KerasTuner's `Oracle.reload` rerun trials a kill interrupted (a fix for KerasTuner 1.4).

    Wraps `keras_tuner.Oracle.reload`, which every oracle (random, Bayesian,
    Hyperband, trainwell's PBT) uses to continue a search from its project
    directory, with `reconcile_reloaded_trials`: see there for the two kill points
    KerasTuner mishandles. Applied by `make_tuner`; gated on KerasTuner < 1.5.
    Returns whether the fix is in place.

    Example:
    >>> recover_interrupted_trials()  # doctest: +SKIP
    True
    """
    if _RELOAD_FIX["applied"]:
        return True
    if not _keras_tuner_needs_fixes():
        return False
    original = oracle_module.Oracle.reload

    def reload(self):
        original(self)
        fixed = reconcile_reloaded_trials(self)
        if (fixed["requeued"] or fixed["dropped"]) and getattr(self, "verbose", 1):
            print(f"trainwell: reloaded search: trials rerun after a kill {fixed['requeued']}, "
                  f"finished trials not rerun {fixed['dropped']}")

    reload.__doc__ = original.__doc__
    reload._trainwell_original = original
    oracle_module.Oracle.reload = reload
    _RELOAD_FIX["applied"] = True
    return True


def serve_chief(oracle, poll_s: float = 0.2) -> None:
    """Serves `oracle` to the workers over gRPC until the search is over.

    KerasTuner's `oracle_chief.start_server` with a shorter poll: it serves the
    same `OracleServicer` on `KERASTUNER_ORACLE_IP:KERASTUNER_ORACLE_PORT` (no
    authentication, no TLS: bind it to 127.0.0.1 or a private network) and returns
    once a worker was told to stop and no trial or worker is left.

    Example:
    >>> serve_chief(tuner.oracle)  # doctest: +SKIP
    """
    import grpc  # lazy: gRPC loads only in a distributed search's chief

    address = f"{os.environ['KERASTUNER_ORACLE_IP']}:{os.environ['KERASTUNER_ORACLE_PORT']}"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    servicer = OracleServicer(oracle)
    protos.get_service_grpc().add_OracleServicer_to_server(servicer, server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"The chief oracle cannot listen on {address} (port in use?).")
    server.start()
    try:
        while not (servicer.stop_triggered and exit_chief(oracle)):
            time.sleep(poll_s)
    finally:
        server.stop(grace=2.0)
