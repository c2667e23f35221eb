"""One boot of the Soft-RoCE VM (vm.py) for every test under tests/vm: under emulation a boot
and an import of torch take minutes, so the verbs transport's GoogleTests, the torch process
groups of verbs_job.py and railcc doctor (run by verbs_job.py) all run in it, and the tests
read what each wrote.

The VM boots as soon as the session has collected a test of this directory, at the lowest CPU
priority, and imports torch while the other tests run (they leave a core idle much of the time
and take it back at once when they need it); it runs nothing that is timed until the first
test here asks for it (the `go` file). Then the emulator is given its normal priority back
(where this session may: root) and the transport's GoogleTests, the process groups and the
doctor run, as before. Its files are kept under pytest's temporary directory, as tmp_path's."""

import os
import subprocess
import sys
import tempfile

import pytest

from vm import SHARE_IN_VM, start_vm, vm_available

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BUILD = os.path.join(ROOT, "build", "cpp")
_started = {}  # "vm": the Vm booted early, or "error": why it could not be


def _boot(session):
    # The GoogleTest binary, built as tests/python/test_cpp_engine.py builds it (a no-op then).
    subprocess.run(["cmake", "-S", ROOT, "-B", BUILD, "-G", "Ninja", "-DRAILCC_BUILD_PYTHON=OFF", "-DRAILCC_BUILD_TESTS=ON"],
                   check=True, timeout=300, capture_output=True)
    subprocess.run(["cmake", "--build", BUILD, "--target", "railcc_tests"], check=True, timeout=1200, capture_output=True)
    # verbs_job.py imports torch (a minute and a half of one emulated CPU), then waits for the
    # GoogleTests, which wait for the go file.
    script = (f"cd /tmp; {sys.executable} {ROOT}/tests/vm/verbs_job.py $OUT $OUT/gtest.rc > $OUT/job.txt 2>&1 & job=$!; "
              f"while [ ! -e {SHARE_IN_VM}/go ]; do sleep 1; done; "
              f"{BUILD}/railcc_tests --gtest_filter='*Verbs*' > $OUT/gtest.txt 2>&1; echo $? > $OUT/gtest.rc; "
              "wait $job; echo $? > $OUT/job.rc; "
              # Last, as it takes a link down and up again.
              f"RAILCC_VM_TEST=1 {BUILD}/railcc_tests --gtest_filter='*PortGoingDown*' > $OUT/portdown.txt 2>&1; "
              "echo $? > $OUT/portdown.rc")
    factory = getattr(session.config, "_tmp_path_factory", None)  # tmp_path's (pytest keeps the last few)
    workdir = factory.mktemp("verbs") if factory is not None else tempfile.mkdtemp(prefix="railcc-vm-")
    _started["vm"] = start_vm(script, workdir, rails=2, nice=19)


def pytest_collection_finish(session):
    # Not for --collect-only, nor when collection failed (the session ends without tests).
    if _started or session.config.option.collectonly or session.testsfailed or not vm_available()[0]:
        return
    if not any(str(item.path).startswith(HERE + os.sep) for item in session.items):
        return
    try:
        _boot(session)
    except Exception as e:  # noqa: BLE001  (the fixture reports it, in the test that needs the VM)
        _started["error"] = f"{type(e).__name__}: {e}"


def pytest_sessionfinish(session):
    vm = _started.pop("vm", None)
    if vm is not None:
        vm.kill()


@pytest.fixture(scope="session")
def vm(request):
    if not _started:
        _boot(request.session)  # collected some other way: boot now
    assert "error" not in _started, f"the VM could not start: {_started['error']}"
    booted = _started["vm"]
    booted.renice(0)
    with open(os.path.join(booted.share, "go"), "w"):
        pass
    res = booted.finish(timeout=1100)
    assert os.path.exists(os.path.join(res.out_dir, "job.rc")), res.log + res.console[-3000:]
    return res
