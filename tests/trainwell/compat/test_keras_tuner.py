"""trainwell.compat.keras_tuner's accessors of KerasTuner's private oracle state.

The save/reload patches of the same module are tested with real searches in
tests/trainwell/tuning/test_tuning.py (the kill-during-save and reload tests).
"""

import keras_tuner
import pytest

from trainwell.compat.keras_tuner import next_oracle_seed, oracle_random_values
from trainwell.compat.versions import UpstreamChanged


def _oracle(seed=1):  # not 0: KerasTuner replaces a falsy seed with a random one
    hp = keras_tuner.HyperParameters()
    hp.Int("units", 1, 2)
    return keras_tuner.oracles.RandomSearchOracle(objective="loss", hyperparameters=hp, seed=seed, max_trials=5)


def test_random_values_samples_like_keras_tuners_own_oracle():
    oracle = _oracle()
    first = oracle_random_values(oracle)
    assert set(first) == {"units"} and first["units"] in (1, 2)
    assert oracle_random_values(_oracle())["units"] == first["units"]  # same seed, same draw


def test_next_oracle_seed_counts_up_from_the_oracles_seed():
    oracle = _oracle(seed=7)
    a, b = next_oracle_seed(oracle), next_oracle_seed(oracle)
    assert b == a + 1 and oracle._seed_state == b + 1


def test_a_missing_private_name_is_one_clear_error():
    class Bare:
        pass

    with pytest.raises(UpstreamChanged, match="Oracle._seed_state"):
        next_oracle_seed(Bare())
    with pytest.raises(UpstreamChanged, match="Oracle._random_values"):
        oracle_random_values(Bare())
