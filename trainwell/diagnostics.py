"""Moved to `trainwell.callbacks.doctor` (the doctor's package, floor 1); this name is an alias of it.

Kept only while `callbacks/lr_finder.py` imports `step_noise` from here and
`trainwell/__init__.py` lists `diagnostics`; delete it once they use
`trainwell.callbacks.doctor`. (An alias on floor 0 of a floor-1 package: the
import-contract test names this file until then.)
"""

import sys

from trainwell.callbacks import doctor as _moved

sys.modules[__name__] = _moved
