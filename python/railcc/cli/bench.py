"""python -m railcc bench ...: railcc-bench (railcc.bench)."""

NAME = "bench"
USAGE = "bench ..."
SUMMARY = "same as railcc-bench"


def run(argv):
    from ..bench import main

    return main(argv)
