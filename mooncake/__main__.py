"""``python -m mooncake``: the command line."""

import sys

from mooncake._cli import main

sys.exit(main())
