"""``python -m elastic_rt.cli``: the ``elastic-rt`` command without its console script."""

import sys

from elastic_rt.cli import main

sys.exit(main())
