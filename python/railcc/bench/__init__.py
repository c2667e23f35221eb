"""railcc-bench, a collective benchmark for torch.distributed backends (see runner.py).

    railcc-bench --nprocs 4 --backend railcc,gloo -o all_reduce
    python -m railcc bench ...   python -m railcc.bench ...   torchrun -m railcc.bench ...

runner.py     the ranks and the sweep; runnable as a file, without the railcc package
args.py       the command line: every argument bounded and checked before anything runs; the run's Config
report.py     sizes, bandwidths, expected outputs, the table, the JSON report and the plot
timing.py     how one collective is timed, and the reference rates (memcpy, device copy, peak RSS)
mpi.py        the Open MPI reference (mpi4py under mpirun); also the script each MPI rank runs
limits.py     what this host can hold (memory, tasks), and ranks that die with their parent

The runner is imported at first use (main), so `railcc.bench.limits` (used by sim) costs no more than itself.
"""


def main(argv=None):
    """railcc-bench's entry point; returns the exit status."""
    from .runner import main as run

    return run(argv)

