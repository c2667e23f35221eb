"""Asks libibverbs what sysfs cannot say: a port's active MTU, and whether a device takes
dma-buf memory registration. Loaded at run time with ctypes, as the engine loads it; on a
host without rdma-core, or without devices, every answer is None."""

import ctypes
import errno

_MTU = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def _lib():
    try:
        lib = ctypes.CDLL("libibverbs.so.1", use_errno=True)
    except OSError:
        return None
    lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.ibv_get_device_name.restype = ctypes.c_char_p
    lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    lib.ibv_open_device.restype = ctypes.c_void_p
    lib.ibv_open_device.argtypes = [ctypes.c_void_p]
    lib.ibv_close_device.argtypes = [ctypes.c_void_p]
    lib.ibv_query_port.argtypes = [ctypes.c_void_p, ctypes.c_uint8, ctypes.c_void_p]
    lib.ibv_alloc_pd.restype = ctypes.c_void_p
    lib.ibv_alloc_pd.argtypes = [ctypes.c_void_p]
    lib.ibv_dealloc_pd.argtypes = [ctypes.c_void_p]
    lib.ibv_dereg_mr.argtypes = [ctypes.c_void_p]
    return lib


def probe(ports_by_device):
    """ports_by_device: {device name: [port numbers]}. Returns {device: {"mtu": {port: bytes},
    "dmabuf": True/False/None, "dmabuf_why": str}} for the devices libibverbs opens."""
    lib = _lib()
    if lib is None:
        return {}
    n = ctypes.c_int(0)
    devs = lib.ibv_get_device_list(ctypes.byref(n))
    if not devs:
        return {}
    out = {}
    try:
        for i in range(n.value):
            name = lib.ibv_get_device_name(devs[i]).decode()
            if name not in ports_by_device:
                continue
            ctx = lib.ibv_open_device(devs[i])
            if not ctx:
                out[name] = {"mtu": {}, "dmabuf": None, "dmabuf_why": f"ibv_open_device failed: {errno.errorcode.get(ctypes.get_errno(), '?')}"}
                continue
            try:
                info = {"mtu": {}, "dmabuf": None, "dmabuf_why": ""}
                for port in ports_by_device[name]:
                    attr = ctypes.create_string_buffer(256)  # struct ibv_port_attr: state, max_mtu, active_mtu, ...
                    if lib.ibv_query_port(ctx, port, attr) == 0:
                        info["mtu"][port] = _MTU.get(ctypes.c_int.from_buffer(attr, 8).value, 0)
                info["dmabuf"], info["dmabuf_why"] = _dmabuf(lib, ctx)
                out[name] = info
            finally:
                lib.ibv_close_device(ctx)
    finally:
        lib.ibv_free_device_list(devs)
    return out


def _dmabuf(lib, ctx):
    """Registers an invalid dma-buf fd: a device without dma-buf support answers EOPNOTSUPP
    or EPROTONOSUPPORT; any other error (EBADF) means the path exists."""
    try:
        reg = lib.ibv_reg_dmabuf_mr
    except AttributeError:
        return False, "this libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)"
    reg.restype = ctypes.c_void_p
    reg.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
    pd = lib.ibv_alloc_pd(ctx)
    if not pd:
        return None, "ibv_alloc_pd failed"
    try:
        ctypes.set_errno(0)
        mr = reg(pd, 0, 0, 0, -1, 0)
        err = ctypes.get_errno()
        if mr:  # cannot happen with fd -1; do not leak it if it does
            lib.ibv_dereg_mr(mr)
            return True, "registration of a test dma-buf succeeded"
        name = errno.errorcode.get(err, str(err))
        if err in (errno.EOPNOTSUPP, errno.EPROTONOSUPPORT):
            return False, f"ibv_reg_dmabuf_mr: {name}"
        return True, f"ibv_reg_dmabuf_mr on an invalid fd: {name} (the path exists)"
    finally:
        lib.ibv_dealloc_pd(pd)
