"""``python -m parity``: the same entry point as the ``parity`` console script."""

import sys

from parity.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
