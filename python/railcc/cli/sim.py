"""python -m railcc sim [-n 1024,4096]: railcc.sim."""

NAME = "sim"
USAGE = "sim [-n 1024,4096]"
SUMMARY = """simulate the schedules at any job size: algorithm, critical path,
peers, messages and bytes per rank, set-up store reads and memory"""


def run(argv):
    from ..sim import main

    return main(argv)
