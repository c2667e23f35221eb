"""railcc's command line, `python -m railcc COMMAND ...` (the `railcc` console script): one module
per command, each with USAGE and SUMMARY (its lines of `python -m railcc --help`) and run(argv),
which is given every argument after the command, as typed, and returns the exit status. The
command's own parser (railcc.sim, railcc.doctor, ...) reads them; this one only picks the command.
"""

import argparse
import sys

from . import bench, doctor, env, sim, topo, trace

COMMANDS = {m.NAME: m for m in (env, bench, trace, doctor, topo, sim)}


def _overview():
    width = max(len(m.USAGE) for m in COMMANDS.values()) + 2
    lines = []
    for m in COMMANDS.values():
        first, *more = m.SUMMARY.splitlines()
        lines.append(f"python -m railcc {m.USAGE:<{width}}{first}")
        lines += [" " * (len("python -m railcc ") + width) + ln for ln in more]
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m railcc", usage="python -m railcc COMMAND [ARGS ...]",
                                description=_overview(), formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="python -m railcc COMMAND --help: that command's own options")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS)
    for name, m in COMMANDS.items():
        # no options of its own: whatever follows the command is left for the command's parser
        sub.add_parser(name, add_help=False).set_defaults(run=m.run)
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    try:
        args, _ = parser.parse_known_args(argv)
    except SystemExit as e:  # --help, or no such command
        return e.code if isinstance(e.code, int) else 2
    # The top parser has no option but --help, so the command is argv[0]; the rest goes on verbatim.
    return args.run(argv[1:])
