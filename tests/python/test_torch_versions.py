"""The c10d glue against the other torch releases users run: the GPU machines have torch 2.11,
CI installs 2.13, PyPI's newest are 2.14.1 and 2.15.0. scripts/check_torch.sh compiles
csrc/backend.cpp and csrc/module.cpp against a release's headers (-fsyntax-only). It needs that
release's wheel, a download of 530-580 MB that a test must not make: the test runs where the
wheel is already cached (bash scripts/check_torch.sh VERSION once puts it there), and skips,
saying so, elsewhere."""

import glob
import os
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CACHE = os.environ.get("RAILCC_WHEEL_DIR", "/tmp/railcc-torch-wheels")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("version", ["2.11.0", "2.14.1", "2.15.0"])
def test_glue_compiles_against_other_torch_headers(version):
    if not glob.glob(os.path.join(CACHE, version, f"torch-{version}-*.whl")):
        pytest.skip(f"torch {version}'s wheel is not in {CACHE}/{version}: run bash scripts/check_torch.sh {version} "
                    "once (a 530 MB download)")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_torch.sh"), version], capture_output=True,
                       text=True, timeout=850)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"torch {version}: csrc/backend.cpp compiles" in r.stdout
    assert f"torch {version}: csrc/module.cpp compiles" in r.stdout
    assert f"torch {version}: csrc/window.cpp compiles" in r.stdout
