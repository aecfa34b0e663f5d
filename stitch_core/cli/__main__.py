"""`python -m stitch_core.cli`: the same as the `stitch` console script."""

import sys

from stitch_core.cli.main import main

sys.exit(main())
