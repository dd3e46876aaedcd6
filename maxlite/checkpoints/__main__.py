"""`python -m maxlite.checkpoints list PATH` and `verify PATH [STEP]`."""

import sys

from maxlite.checkpoints.listing import main

sys.exit(main())
