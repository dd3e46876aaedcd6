"""`python -m maxlite.checkpoints list PATH`."""

import sys

from maxlite.checkpoints.listing import main

sys.exit(main())
