"""The layering of csrc, checked on every run: common <- transport, cuda, topology <- engine <- glue.
Every arrow points down; nothing below the glue includes torch, c10 or pybind11; and every
source file stays a room a newcomer can hold in their head."""

import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CSRC = os.path.join(ROOT, "csrc")

# What each layer may include from the project (by top folder under csrc).
ALLOWED = {
    "common": {"common"},
    "transport": {"common", "transport"},
    "cuda": {"common", "cuda"},
    "topology": {"common", "topology"},
    "engine": {"common", "transport", "cuda", "topology", "engine"},
}
FOREIGN = re.compile(r"#\s*include\s*[<\"](torch|c10|ATen|pybind11|Python\.h)")
PROJECT = re.compile(r"#\s*include\s*\"([^\"]+)\"")
MAX_LINES = 1000
# The engine's files are smaller still: every later change (lazy connections, new algorithms,
# shrink) lands in them.
MAX_ENGINE_LINES = 600


def _sources():
    for dirpath, _, files in os.walk(CSRC):
        for f in sorted(files):
            if f.endswith((".h", ".cpp", ".cu", ".cuh")):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, CSRC), path


def test_every_include_points_down():
    bad = []
    for rel, path in _sources():
        layer = rel.split(os.sep)[0] if os.sep in rel else "glue"
        if layer not in ALLOWED:
            continue  # the c10d glue (csrc/*.cpp) may include anything
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if FOREIGN.search(line):
                    bad.append(f"{rel}:{n}: {layer} includes torch/pybind: {line.strip()}")
                m = PROJECT.search(line)
                if m:
                    target = m.group(1).split("/")[0] if "/" in m.group(1) else "glue"
                    if target not in ALLOWED[layer]:
                        bad.append(f"{rel}:{n}: {layer} includes {target}: {line.strip()}")
    assert not bad, "upward or foreign includes:\n" + "\n".join(bad)


# The engine knows transports only through the contract: the headers directly in transport/
# (transport.h, connection.h, local.h, ...), never a named transport's folder or namespace.
NAMED_TRANSPORT = re.compile(r"#\s*include\s*\"transport/[^/\"]+/|\btransport::(shm|socket|verbs)::")
# The c10d glue reaches the engine through its public headers only (docs/architecture.md).
ENGINE_PUBLIC = {"engine/allocator_segments.h", "engine/communicator.h", "engine/rail_check.h", "engine/simulate.h", "engine/store_watch.h"}


def _naming_a_transport(keep):
    """Lines of the sources `keep(rel)` selects that name a transport's folder or namespace."""
    bad = []
    for rel, path in _sources():
        if not keep(rel):
            continue
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if NAMED_TRANSPORT.search(line.split("//")[0]):
                    bad.append(f"{rel}:{n}: {line.strip()}")
    return bad


def test_the_engine_names_no_transport():
    bad = _naming_a_transport(lambda rel: rel.startswith("engine" + os.sep))
    assert not bad, "the engine reaches past the transport contract:\n" + "\n".join(bad)


def test_the_glue_includes_only_the_engines_public_headers():
    bad = []
    for rel, path in _sources():
        if os.sep in rel:
            continue  # the glue is csrc/*.cpp and csrc/*.h
        with open(path) as f:
            for n, line in enumerate(f, 1):
                m = PROJECT.search(line)
                if m and m.group(1).startswith("engine/") and m.group(1) not in ENGINE_PUBLIC:
                    bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, f"glue includes engine internals (public: {sorted(ENGINE_PUBLIC)}):\n" + "\n".join(bad)
    doc = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    for h in ENGINE_PUBLIC:
        assert h in doc, f"docs/architecture.md does not name the public header {h}"


def test_the_glue_names_no_transport():
    # The glue asks the transports (their rules for the doctor, their statistics) through the
    # contract's headers directly in transport/ (rules.h, stats.h, ...), as the engine does.
    bad = _naming_a_transport(lambda rel: os.sep not in rel)  # the glue: csrc/*.cpp and csrc/*.h
    assert not bad, "the glue reaches past the transport contract:\n" + "\n".join(bad)


def test_source_files_stay_small():
    big = []
    for rel, path in _sources():
        with open(path) as f:
            n = sum(1 for _ in f)
        limit = MAX_ENGINE_LINES if rel.startswith("engine" + os.sep) else MAX_LINES
        if n > limit:
            big.append(f"{rel}: {n} lines (at most {limit})")
    assert not big, "files too long:\n" + "\n".join(big)


def test_the_engine_core_is_an_owner_of_parts():
    """CommImpl keeps its state in parts (the channel layer, the op queue, the device state...),
    each with its lock beside it: no more than ~25 data members of its own."""
    with open(os.path.join(CSRC, "engine", "comm_impl.h")) as f:
        text = f.read()
    body = text[text.index("class CommImpl"):]
    # Data members are the names ending in '_' declared at class level (two-space indent).
    members = re.findall(r"^  (?!//)[^(){};=]*?\b([a-z]\w*_)(?:\s*=[^;]*|\{[^}]*\})?;", body, re.M)
    members += re.findall(r"^  \} ([a-z]\w*_);", body, re.M)
    assert len(members) <= 28, f"CommImpl has {len(members)} data members: {members}"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_exists(layer):
    assert os.path.isdir(os.path.join(CSRC, layer)), layer
