"""`python -m trainwell.cli ...`: the `trainwell` command (what `trainwell.launch` starts its workers with)."""

import sys

from trainwell.cli import main

sys.exit(main())
