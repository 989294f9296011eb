"""``python -m parity``: the ``parity`` console script."""

import sys

from parity.cli.main import main

sys.exit(main())
