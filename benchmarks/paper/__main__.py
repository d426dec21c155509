"""``python -m benchmarks.paper``: the paper's experiments (benchmarks.paper.cli)."""

import sys

from benchmarks.paper.cli import main

sys.exit(main())
