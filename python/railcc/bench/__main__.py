"""python -m railcc.bench ... / torchrun -m railcc.bench ...: the same as railcc-bench."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())
