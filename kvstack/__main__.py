"""``python -m kvstack``: the same as the ``kvstack`` command."""

import sys

from kvstack.cli import main

sys.exit(main())
