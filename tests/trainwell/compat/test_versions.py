"""trainwell.compat.versions: the gate warns once per name outside the tested range."""

import warnings

import pytest

from trainwell.compat import versions


def test_gate_is_silent_on_the_installed_versions():
    assert versions.in_range(versions.keras_version(), versions.TESTED_KERAS)
    assert versions.in_range(versions.tf_version(), versions.TESTED_TF)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.gate("Model._symbolic_build")


def test_gate_warns_once_per_name_on_an_untested_keras(monkeypatch):
    monkeypatch.setattr(versions, "keras_version", lambda: (3, 99))
    monkeypatch.setattr(versions, "_warned", set())
    with pytest.warns(UserWarning, match=r"private keras name `X._y`.*keras 3.99 is installed"):
        versions.gate("X._y")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.gate("X._y")  # once only
    err = versions.upstream_changed("X._y")
    assert "keras 3.99 does not have" in str(err) and "3.8 to below 3.16" in str(err)
