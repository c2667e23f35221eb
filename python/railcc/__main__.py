"""python -m railcc COMMAND ...: see railcc.cli. `main` stays here too, for the `railcc` console
script of installs made when it lived here."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
