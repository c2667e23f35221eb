"""python -m railcc trace DIR [--json]: railcc.trace."""

NAME = "trace"
USAGE = "trace DIR [--json]"
SUMMARY = "merge the flight-recorder dumps of all ranks into one verdict"


def run(argv):
    from ..trace import main

    return main(argv)
