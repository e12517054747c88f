"""Moved to `trainwell.compat.keras_fixes`; this name stays an alias of that module.

Kept only while `trainwell/runtime.py` and `trainwell/recipe.py` import
`trainwell.keras_fixes`; delete it once they import `trainwell.compat.keras_fixes`.
"""

import sys

from trainwell.compat import keras_fixes as _moved

sys.modules[__name__] = _moved
