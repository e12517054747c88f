"""Tests of trainwell.pbt.PBTOracle without training: trials are run by hand with made-up scores.

The search with real training (exploit copies the optimizer state) is in test_tuning.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest


def _oracle(tmp_path, **kw):
    import keras_tuner as kt

    from trainwell.tuning.pbt import PBTOracle

    hp = kt.HyperParameters()
    hp.Float("lr", 1e-4, 1.0, sampling="log", default=0.01)
    hp.Float("smoothing", 0.0, 0.3, default=0.0)
    hp.Int("units", 4, 64, default=16)
    hp.Choice("batch_size", [32, 64], default=32)
    args = dict(objective=kt.Objective("val_accuracy", "max"), population_size=4, ready_interval=2, generations=3,
                hyperparameters=hp, seed=1, static_hyperparameters=("batch_size",))
    args.update(kw)
    oracle = PBTOracle(**args)
    oracle._set_project_dir(str(tmp_path), "p")
    return oracle


def _run(oracle, score_of, tuner_id="t0", fail=()):
    """Creates one trial, 'trains' it and ends it; returns the trial (None when STOPPED/IDLE)."""
    from keras_tuner.src.engine.trial import TrialStatus

    trial = oracle.create_trial(tuner_id)
    if trial.status != TrialStatus.RUNNING:
        return None
    v = trial.hyperparameters.values
    if (v["pbt/member"], v["pbt/generation"]) in fail:
        trial.status, trial.message = TrialStatus.FAILED, "FailedTrialError: Trial diverged: nonfinite_loss"
    else:
        oracle.update_trial(trial.trial_id, {"val_accuracy": score_of(v)})
        trial.status = TrialStatus.COMPLETED
    oracle.end_trial(trial)
    return oracle.get_trial(trial.trial_id)


def _score(v):  # member 3 is always best, member 0 worst
    return 0.5 + 0.1 * v["pbt/member"] + 0.01 * v["pbt/generation"]


def test_arguments_are_validated_with_the_received_idiom(tmp_path):
    with pytest.raises(ValueError, match=r"Expected an int >= 2. Received: population_size=1"):
        _oracle(tmp_path, population_size=1)
    with pytest.raises(ValueError, match=r"Received: ready_interval=0"):
        _oracle(tmp_path, ready_interval=0)
    with pytest.raises(ValueError, match=r"Received: truncation_fraction=0.7"):
        _oracle(tmp_path, truncation_fraction=0.7)
    with pytest.raises(ValueError, match=r"Received: perturb_factors=\(1.0,\)"):
        _oracle(tmp_path, perturb_factors=(1.0,))
    with pytest.raises(ValueError, match=r"Received: resample_probability=2"):
        _oracle(tmp_path, resample_probability=2)
    with pytest.raises(ValueError, match=r"Received: max_trials=5"):
        _oracle(tmp_path, max_trials=5)
    from trainwell.tuning.pbt import PBTTuner

    with pytest.raises(ValueError, match=r"Expected a bool. Received: reuse_models='yes'"):
        PBTTuner(None, reuse_models="yes")
    cfg = _oracle(tmp_path).get_config()
    assert cfg["population_size"] == 4 and cfg["perturb_factors"] == [0.8, 1.2] and cfg["resample_probability"] == 0.25


def test_population_exploit_explore_and_lineage(tmp_path):
    oracle = _oracle(tmp_path)
    trials = []
    while (t := _run(oracle, _score)) is not None:
        trials.append(t)
    assert len(trials) == 12  # 4 members x 3 generations
    lineage = oracle.lineage()
    assert [(r["member"], r["generation"]) for r in lineage[:4]] == [(m, 0) for m in range(4)]
    first = lineage[0]
    assert first["hyperparameters"] == {"lr": 0.01, "smoothing": 0.0, "units": 16, "batch_size": 32}  # defaults
    assert all(r["action"] == "start" and r["parent"] is None for r in lineage[:4])
    by_id = {r["trial_id"]: r for r in lineage}
    for g in (1, 2):
        gen = [r for r in lineage if r["generation"] == g]
        assert sorted(r["member"] for r in gen) == [0, 1, 2, 3]
        assert all(r["initial_epoch"] == 2 * g and r["epochs"] == 2 * g + 2 for r in gen)
        exploit = [r for r in gen if r["action"] == "exploit"]
        # bottom 25% (member 0) copies the top 25% (member 3); the others continue
        assert [(r["member"], r["donor"]) for r in exploit] == [(0, 3)]
        parent = by_id[exploit[0]["parent"]]
        assert parent["member"] == 3 and parent["generation"] == g - 1
        for r in gen:
            if r["action"] == "continue":
                p = by_id[r["parent"]]
                assert p["member"] == r["member"] and p["generation"] == g - 1
                assert r["hyperparameters"] == p["hyperparameters"]
        # explore: each value x0.8 / x1.2 of the donor's (log or linear), or resampled, within bounds
        new, old = exploit[0]["hyperparameters"], parent["hyperparameters"]
        assert new["batch_size"] == old["batch_size"]  # static: inherited
        assert 1e-4 <= new["lr"] <= 1.0 and 0.0 <= new["smoothing"] <= 0.3 and 4 <= new["units"] <= 64
    assert oracle.create_trial("t0").status == "STOPPED"


def test_explore_perturbs_by_the_factors_or_resamples(tmp_path):
    oracle = _oracle(tmp_path, resample_probability=0.0)
    rng = np.random.default_rng(0)
    ratios = set()
    for _ in range(50):
        new = oracle.explore({"lr": 0.01, "smoothing": 0.1, "units": 20, "batch_size": 64}, rng)
        ratios.add(round(new["lr"] / 0.01, 6))
        assert round(new["smoothing"] / 0.1, 6) in (0.8, 1.2)
        assert new["units"] in (16, 24) and new["batch_size"] == 64
    assert ratios == {0.8, 1.2}
    # bounds: clipped; a linear value at 0 moves by a tenth of its range times (factor - 1)
    new = oracle.explore({"lr": 1.0, "smoothing": 0.0, "units": 64, "batch_size": 32}, np.random.default_rng(1))
    assert new["lr"] <= 1.0 and new["units"] <= 64 and new["smoothing"] in (0.0, pytest.approx(0.006))
    always = _oracle(tmp_path, resample_probability=1.0)
    samples = [always.explore({"lr": 0.01, "smoothing": 0.1, "units": 20, "batch_size": 64},
                              np.random.default_rng(i))["lr"] for i in range(20)]
    assert any(round(s / 0.01, 6) not in (0.8, 1.2) for s in samples)  # resampled from the prior


def test_a_diverged_member_is_replaced_at_once_by_an_exploit(tmp_path):
    from keras_tuner.src.engine.trial import TrialStatus

    oracle = _oracle(tmp_path)
    for _ in range(4):
        _run(oracle, _score)
    # member 1's segment in generation 1 diverges once (member 1 is not in the bottom 25%)
    failed_once = []
    while True:
        fail = set() if failed_once else {(1, 1)}
        tr = _run(oracle, _score, fail=fail)
        if tr is None:
            break
        if tr.status == TrialStatus.FAILED:
            failed_once.append(tr.trial_id)
    lineage = oracle.lineage()
    failed = [r for r in lineage if r["status"] == "FAILED"]
    assert [(r["member"], r["generation"]) for r in failed] == [(1, 1)]
    i = lineage.index(failed[0])
    nxt = lineage[i + 1]  # the very next trial replaces it, before any other member moves on
    assert (nxt["member"], nxt["generation"], nxt["action"]) == (1, 1, "replace")
    assert nxt["donor"] == 3 and lineage[[r["trial_id"] for r in lineage].index(nxt["parent"])]["generation"] == 0
    done = {(r["member"], r["generation"]) for r in lineage if r["status"] == "COMPLETED"}
    assert done == {(m, g) for m in range(4) for g in range(3)}
    assert len(failed_once) == 1


def test_workers_wait_at_the_generation_barrier(tmp_path):
    from keras_tuner.src.engine.trial import TrialStatus

    oracle = _oracle(tmp_path, population_size=2, generations=2)
    a = oracle.create_trial("w0")
    b = oracle.create_trial("w1")
    assert a.status == b.status == TrialStatus.RUNNING
    oracle.update_trial(a.trial_id, {"val_accuracy": 0.9})
    a.status = TrialStatus.COMPLETED
    oracle.end_trial(a)
    # member 0 is done with generation 0 but member 1 is not: nothing to hand out yet
    assert oracle.create_trial("w0").status == TrialStatus.IDLE
    oracle.update_trial(b.trial_id, {"val_accuracy": 0.5})
    b.status = TrialStatus.COMPLETED
    oracle.end_trial(b)
    c = oracle.create_trial("w0")
    assert c.hyperparameters.values["pbt/generation"] == 1


def test_state_survives_a_reload(tmp_path):
    oracle = _oracle(tmp_path)
    for _ in range(6):
        _run(oracle, _score)
    running = oracle.create_trial("t0")  # killed while running
    oracle.save()
    again = _oracle(tmp_path)
    again.reload()
    assert [r["trial_id"] for r in again.lineage()] == [r["trial_id"] for r in oracle.lineage()]
    # the interrupted trial is retried first, with the same values
    retry = again.create_trial("t1")
    assert retry.trial_id == running.trial_id and retry.hyperparameters.values == running.hyperparameters.values
    with pytest.raises(ValueError, match="other settings"):
        other = _oracle(tmp_path, population_size=5)
        other.reload()
    assert math.isfinite(again.get_state()["seed_state"])
