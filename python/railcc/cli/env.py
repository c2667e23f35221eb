"""python -m railcc env [--markdown]: railcc's parameters, with their effective values and sources."""

import argparse

NAME = "env"
USAGE = "env [--markdown]"
SUMMARY = "list railcc's parameters (effective values, sources)"


def _allowed(p):
    a = p["allowed"]
    if ".." in a:
        lo, hi = a.split("..")
        return f"{lo} to {hi}"
    return a.replace("|", ", ")


def env_table(markdown=False):
    from .. import params

    rows = params()
    if markdown:
        out = ["| variable | NCCL fallback | type | default | allowed | meaning |", "|---|---|---|---|---|---|"]
        for p in rows:
            out.append(f"| `{p['env']}` | {('`' + p['fallback'] + '`') if p['fallback'] else ''} | {p['type']} | "
                       f"`{p['default']}` | {_allowed(p)} | {p['description']} |")
        return "\n".join(out)
    width = max(len(p["env"]) for p in rows)
    lines = []
    for p in rows:
        lines.append(f"{p['env']:<{width}}  {p['value']!r:<14} ({p['source']})  {p['description']}")
        if p["problem"]:
            lines.append(f"{'':<{width}}  ^ REFUSED: {p['problem']}; init fails until it is fixed")
    return "\n".join(lines)


def run(argv):
    ap = argparse.ArgumentParser(prog="railcc env", description=__doc__.split(": ", 1)[1])
    ap.add_argument("--markdown", action="store_true", help="print the table of docs/configuration.md")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    print(env_table(markdown=a.markdown))
    return 0
