"""The plugin half of the conformance suite: deselects and xfails from the module's one list.

`test_keras_suites.py` loads Keras's own test files from the installed wheel and
defines `DEVIATIONS`, the one list of Keras tests that do not apply to trainwell
as they stand. Deselecting needs a collection hook, which only a conftest (or a
plugin) may define; this one reads that list from each collected item's module,
so the list and what is deselected cannot drift apart.
"""

from __future__ import annotations

import pytest

_DESELECTED = pytest.StashKey[list]()


def pytest_configure(config):
    # Keras's conftest (not in the wheel) registers the marker its tests carry;
    # it skips them on backends that cannot train, which never applies here.
    config.addinivalue_line("markers", "requires_trainable_backend: Keras's marker; runs on every backend here")


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, so every listed test is seen
def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        deviations = getattr(getattr(item, "module", None), "DEVIATIONS", None)
        key_of = getattr(getattr(item, "module", None), "deviation_key", None)
        key = key_of(item) if deviations is not None and key_of is not None else None
        entry = deviations.get(key) if key is not None else None
        if entry is None:
            kept.append(item)
        elif entry["kind"] in ("deviation", "empty"):
            dropped.append(item)
        else:  # "defect": fixed elsewhere; strict, so the fix shows up as a failure to remove the entry
            item.add_marker(pytest.mark.xfail(strict=True, reason=entry["reason"]))
            kept.append(item)
    config.stash[_DESELECTED] = dropped
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    dropped = config.stash.get(_DESELECTED, [])
    if dropped:
        terminalreporter.write_line(
            f"tests/conformance: {len(dropped)} Keras tests deselected as deliberate deviations or empty in Keras "
            "(reasons: DEVIATIONS in tests/conformance/test_keras_suites.py)"
        )
