"""Real RDMA verbs on a machine without an RDMA NIC: Debian's kernel booted in qemu (software
emulation, no disk image) with Soft-RoCE (rdma_rxe) on a veth pair.

    from vm import vm_available, run_in_vm
    ok, why = vm_available()
    res = run_in_vm("python -m railcc doctor --json > $OUT/doctor.json", tmp_path, rails=2)
    res.rc, res.log, res.out_dir
    vm = start_vm(script, tmp_path, rails=2, nice=19)  # returns at once; vm.finish(timeout) waits

The VM sees this machine's root read-only through virtio-9p, so the same Python, torch and
railcc run inside it; a writable share is the job's $OUT. Inside, each rail is a veth pair
with an rxe device on one end (rxe0 on 10.77.0.1, rxe1 on 10.78.0.1, ...), `ulimit -l` is
unlimited, and the script runs as root in a chroot of the host root. Needs the packages
qemu-system-x86, linux-image-amd64, busybox-static, rdma-core (scripts/install.sh installs them).
"""

import ctypes
import functools
import glob
import gzip
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Loaded in this order in the initrd, to mount the host's root over virtio-9p.
_INITRD_MODULES = ["virtio_ring", "virtio", "virtio_pci_modern_dev", "virtio_pci_legacy_dev", "virtio_pci",
                   "netfs", "fscache", "9pnet", "9pnet_virtio", "9p"]
SHARE_IN_VM = "/tmp/railcc-vm-out"
# This checkout, shared on its own: it may sit under /tmp, which the VM covers with a tmpfs.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kernel():
    ks = sorted(glob.glob("/boot/vmlinuz-*"))
    if not ks:
        return None, None
    k = ks[-1]
    return k, k.split("vmlinuz-", 1)[1]


@functools.lru_cache(maxsize=None)  # asked by each test module and the session's early boot
def vm_available():
    """(True, "") when a Soft-RoCE VM can boot here, else (False, why)."""
    for tool in ("qemu-system-x86_64", "busybox"):
        if shutil.which(tool) is None:
            return False, f"{tool} not installed (bash scripts/install.sh)"
    kernel, ver = _kernel()
    if kernel is None:
        return False, "no /boot/vmlinuz-* (apt-get install linux-image-amd64)"
    for m in _INITRD_MODULES + ["rdma_rxe", "veth"]:
        if subprocess.run(["modinfo", "-k", ver, "-n", m], capture_output=True).returncode != 0:
            return False, f"kernel {ver} has no module {m}"
    if not os.access(kernel, os.R_OK):
        return False, f"{kernel} is not readable"
    return True, ""


@dataclass
class VmResult:
    rc: int  # the script's exit status; -1 when the VM did not report one
    log: str  # the script's stdout and stderr
    console: str  # the VM's serial console (boot messages)
    out_dir: str  # what the script wrote under $OUT


def _initrd(workdir, ver):
    root = os.path.join(workdir, "initrd")
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "mods"))
    shutil.copy(shutil.which("busybox"), os.path.join(root, "bin", "busybox"))
    for m in _INITRD_MODULES:
        path = subprocess.run(["modinfo", "-k", ver, "-n", m], capture_output=True, text=True, check=True).stdout.strip()
        dst = os.path.join(root, "mods", m + ".ko")
        if path.endswith(".xz"):
            subprocess.run(["sh", "-c", f"xz -dc '{path}' > '{dst}'"], check=True)
        else:
            shutil.copy(path, dst)
    init = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in {' '.join(_INITRD_MODULES)}; do insmod /mods/$m.ko || echo "railcc-vm: insmod $m failed"; done
mkdir -p /host
mount -t 9p -o trans=virtio,version=9p2000.L,ro hostroot /host || echo "railcc-vm: host root not mounted"
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/shm; mount -t tmpfs -o size=1g shm /host/dev/shm
mount -t tmpfs tmp /host/tmp; mount -t tmpfs run /host/run
mkdir -p "/host{_REPO}"; mount -t 9p -o trans=virtio,version=9p2000.L,ro repo "/host{_REPO}"
mkdir -p /host{SHARE_IN_VM}; mount -t 9p -o trans=virtio,version=9p2000.L work /host{SHARE_IN_VM}
chroot /host /bin/sh {SHARE_IN_VM}/job.sh > /host{SHARE_IN_VM}/job.log 2>&1
echo $? > /host{SHARE_IN_VM}/job.rc
sync
poweroff -f
"""
    with open(os.path.join(root, "init"), "w") as f:
        f.write(init)
    os.chmod(os.path.join(root, "init"), 0o755)
    cpio = os.path.join(workdir, "initrd.cpio.gz")
    files = subprocess.run(["sh", "-c", "find . | sort"], cwd=root, capture_output=True, text=True, check=True).stdout
    data = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files.encode(),
                          capture_output=True, check=True).stdout
    with gzip.open(cpio, "wb", compresslevel=1) as f:
        f.write(data)
    return cpio


def _job(script, rails):
    lines = ["set -e", "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             f"export OUT={SHARE_IN_VM}/out HOME=/tmp PYTHONDONTWRITEBYTECODE=1",
             f"export PYTHONPATH='{_REPO}/python'${{PYTHONPATH:+:$PYTHONPATH}}", 'mkdir -p "$OUT"',
             # crc32 first: the kernel cannot auto-load it from inside the chroot, and rxe needs it.
             "modprobe crc32_generic; modprobe crc32_pclmul 2>/dev/null || true",
             "modprobe rdma_rxe; modprobe veth", "ip link set lo up", "hostname railcc-vm"]
    for r in range(rails):
        lines += [f"ip link add vrail{r} type veth peer name vrail{r}p",
                  f"ip addr add 10.{77 + r}.0.1/24 dev vrail{r}",
                  f"ip link set vrail{r} up; ip link set vrail{r}p up",
                  f"rdma link add rxe{r} type rxe netdev vrail{r}"]
    lines += ["ulimit -l unlimited", "set +e", script]
    return "\n".join(lines) + "\n"


class Vm:
    """A VM booted by start_vm(), running its script; finish() waits for it."""

    def __init__(self, proc, share, console):
        self.proc = proc
        self.share = share  # the script's directory, /tmp/railcc-vm-out inside
        self.console = console  # the serial console's file (a file: nobody may read a pipe for minutes)

    def finish(self, timeout):
        """Waits up to `timeout` s for the VM to power off (kills it then) and returns a VmResult."""
        note = ""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            note = f"railcc-vm: timed out after {timeout}s\n"
        with open(self.console, errors="replace") as f:
            console = note + f.read()
        share = self.share
        rc_path, log_path = os.path.join(share, "job.rc"), os.path.join(share, "job.log")
        rc = int(open(rc_path).read().strip() or -1) if os.path.exists(rc_path) else -1
        log = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
        return VmResult(rc, log, console, os.path.join(share, "out"))

    def renice(self, nice=0):
        """Every thread of the emulator at `nice`, where allowed (raising a priority needs root
        or RLIMIT_NICE; otherwise the threads keep theirs)."""
        try:
            tids = os.listdir(f"/proc/{self.proc.pid}/task")
        except OSError:  # exited
            return
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except OSError:  # gone, or not allowed
                pass

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_vm(script, workdir, rails=1, memory_mb=3072, env=None, nice=0):
    """Boots the VM, which runs `script` (sh) inside after setting up `rails` rxe devices, and
    returns a Vm at once. `env` adds exported variables; `nice` > 0 runs the emulator at that
    lower CPU priority (all its threads), so it takes only what other work leaves idle."""
    kernel, ver = _kernel()
    workdir = str(workdir)
    share = tempfile.mkdtemp(prefix="share-", dir=workdir)
    exports = "".join(f"export {k}='{v}'\n" for k, v in (env or {}).items())
    with open(os.path.join(share, "job.sh"), "w") as f:
        f.write(exports + _job(script, rails))
    cmd = ["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", str(memory_mb), "-smp", "2",
           "-nographic", "-no-reboot", "-kernel", kernel, "-initrd", _initrd(workdir, ver),
           "-append", "console=ttyS0 panic=-1 quiet",
           "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
           "-virtfs", f"local,path={_REPO},mount_tag=repo,security_model=none,readonly=on,multidevs=remap",
           "-virtfs", f"local,path={share},mount_tag=work,security_model=none,multidevs=remap"]
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()  # looked up before the fork

    def child():  # the emulator dies with this process: a VM started early must not outlive its session
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # this process died before that took effect
            os._exit(1)
        if nice > 0:
            os.nice(nice)

    console = os.path.join(workdir, "console.txt")
    with open(console, "w") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, preexec_fn=child)
    return Vm(proc, share, console)


def run_in_vm(script, workdir, rails=1, timeout=300, memory_mb=3072, env=None):
    """Boots the VM, runs `script` (sh) inside after setting up `rails` rxe devices, and
    returns a VmResult. `env` adds exported variables."""
    return start_vm(script, workdir, rails, memory_mb, env).finish(timeout)


if __name__ == "__main__":  # python tests/vm/vm.py 'ibv_devices; rdma link'
    ok, why = vm_available()
    if not ok:
        sys.exit(f"no VM: {why}")
    res = run_in_vm(" ".join(sys.argv[1:]) or "ibv_devices; rdma link", tempfile.mkdtemp(), rails=2)
    print(res.log)
    print(f"rc {res.rc}")
    sys.exit(0 if res.rc == 0 else 1)
