"""``python -m mooncake ...``: the same command line as the ``mooncake`` console script."""

import sys

from mooncake._cli import main

sys.exit(main())
