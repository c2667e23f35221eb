"""python -m railcc trace DIR: merge the flight-recorder dumps of all ranks into one verdict.

verdict.py   the analysis and the printed verdict; runnable as a file with the standard library alone
load.py      reading one rank's dump, refusing anything the analysis could trip on
"""


def main(argv=None):
    """python -m railcc trace's entry point; returns the exit status."""
    from .verdict import main as run

    return run(argv)

