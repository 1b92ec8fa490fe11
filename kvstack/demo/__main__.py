"""``python -m kvstack.demo``: the same as ``kvstack demo``."""

import sys

from kvstack.demo.cli import main

sys.exit(main())
