"""`python -m ray_entry.train base.yml key=value ...`: train with Ray Train's JaxTrainer.

Attaches to the cluster in RAY_ADDRESS (what `ray job submit` sets), else starts a local one.
All logic lives in `maxlite.launch.ray_trainer`.
"""

from __future__ import annotations

import sys
from typing import Sequence

from maxlite import cli, config as C


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m ray_entry.train [base.yml|your.yml] key=value ...\n"
              "keys, defaults and comments: maxlite/configs/base.yml (Ray: section 'launch: ray')",
              file=sys.stderr)
        return 0 if argv else 2
    from maxlite.launch import ray_trainer

    return int(ray_trainer.run(C.load(argv))["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
