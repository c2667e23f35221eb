"""python -m railcc doctor [--json]: railcc.doctor."""

NAME = "doctor"
USAGE = "doctor [--json]"
SUMMARY = """check this host's GPU/RDMA/network/shm/NUMA set-up, with fixes
(railcc doctor --help; --all-ranks under torchrun compares hosts)"""


def run(argv):
    from ..doctor import main

    return main(argv)
