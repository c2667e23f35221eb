"""python -m railcc.trace DIR [--json] [--size N]: the same as python -m railcc trace."""

import sys

from .verdict import main

if __name__ == "__main__":
    sys.exit(main())
