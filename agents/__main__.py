"""``python3 -m agents`` is ``python3 -m agents.agent``."""

import sys

from .agent import main

sys.exit(main())
