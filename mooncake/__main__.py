"""``python -m mooncake ...`` is the ``mooncake`` command."""

import sys

from mooncake._cli import main

sys.exit(main())
