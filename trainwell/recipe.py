"""TEMPORARY (issue 19): the recipe harness moved to `trainwell.recipes.harness`.

Helper A's tests/faults/test_damaged_checkpoints.py and test_concurrent_runs.py still
import it from here. Delete this module once they import `trainwell.recipes.harness`
(after the merge); the architecture test lists it as a known upward edge until then.
"""

from trainwell.recipes.harness import advance_epochs, resume_epoch, setup_run  # noqa: F401
