"""``python -m fedrl.cli``."""

import sys

from fedrl.cli import main

sys.exit(main())
