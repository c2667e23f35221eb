"""One boot of the Soft-RoCE VM (vm.py) for every test under tests/vm: under emulation a boot
and an import of torch take minutes, so the verbs transport's GoogleTests, the torch process
groups of verbs_job.py and railcc doctor (run by verbs_job.py) all run in it, and the tests
read what each wrote."""

import os
import subprocess
import sys

import pytest

from vm import run_in_vm

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(ROOT, "build", "cpp")


@pytest.fixture(scope="session")
def vm(tmp_path_factory):
    # The GoogleTest binary, built as tests/python/test_cpp_engine.py builds it (a no-op then).
    subprocess.run(["cmake", "-S", ROOT, "-B", BUILD, "-G", "Ninja", "-DRAILCC_BUILD_PYTHON=OFF", "-DRAILCC_BUILD_TESTS=ON"],
                   check=True, timeout=300, capture_output=True)
    subprocess.run(["cmake", "--build", BUILD, "--target", "railcc_tests"], check=True, timeout=1200, capture_output=True)
    # The GoogleTests run while verbs_job.py imports torch (about a minute and a half of one
    # emulated CPU); its ranks start once they are done (the gtest.rc it waits for).
    script = (f"cd /tmp; ({BUILD}/railcc_tests --gtest_filter='*Verbs*' > $OUT/gtest.txt 2>&1; echo $? > $OUT/gtest.rc) & "
              f"{sys.executable} {ROOT}/tests/vm/verbs_job.py $OUT $OUT/gtest.rc > $OUT/job.txt 2>&1; echo $? > $OUT/job.rc; wait; "
              # Last, as it takes a link down and up again.
              f"RAILCC_VM_TEST=1 {BUILD}/railcc_tests --gtest_filter='*PortGoingDown*' > $OUT/portdown.txt 2>&1; "
              "echo $? > $OUT/portdown.rc")
    res = run_in_vm(script, tmp_path_factory.mktemp("verbs"), rails=2, timeout=1100)
    assert os.path.exists(os.path.join(res.out_dir, "job.rc")), res.log + res.console[-3000:]
    return res


