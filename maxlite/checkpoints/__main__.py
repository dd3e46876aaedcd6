"""`python -m maxlite.checkpoints list PATH` and `verify PATH [STEP]`."""

import sys

from maxlite.checkpoints.listing import main

if __name__ == "__main__":
    sys.exit(main())
