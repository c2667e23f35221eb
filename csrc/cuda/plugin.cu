// The CUDA plugin: fills railcc::cuda::DeviceApi with the CUDA runtime and railcc's kernels.
// Built into librailcc_cuda.so, linked against the shared runtime (the same libcudart that
// torch loads, so streams and events are shared with it), and dlopen'ed by the engine.
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstring>

#include "cuda/device_api.h"
#include "cuda/reduce_kernels.h"
#include "cuda/shot_kernels.h"

namespace railcc::cuda {
namespace {

// A failed runtime call also sets the calling thread's "last error", which torch's next
// kernel-launch check on the same thread (future callbacks run on the engine's thread) would
// report as its own. Every wrapper returns the error and clears it; NotReady included.
int ret(cudaError_t e) {
  if (e != cudaSuccess) (void)cudaGetLastError();
  return static_cast<int>(e);
}

const char* errorString(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }
int deviceCount(int* n) { return ret(cudaGetDeviceCount(n)); }
int setDevice(int d) { return ret(cudaSetDevice(d)); }
int getDevice(int* d) { return ret(cudaGetDevice(d)); }

int pointerDevice(const void* p, int* device) {
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // older runtimes flag plain host pointers; do not leave it sticky
    *device = -1;
    return e == cudaErrorInvalidValue ? 0 : e;
  }
  *device = (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) ? a.device : -1;
  return 0;
}

int hostAlloc(void** p, size_t bytes) { return ret(cudaHostAlloc(p, bytes, cudaHostAllocPortable)); }
int hostFree(void* p) { return ret(cudaFreeHost(p)); }
int streamCreate(void** s) {
  return ret(cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(s), cudaStreamNonBlocking));
}
int streamDestroy(void* s) { return ret(cudaStreamDestroy(static_cast<cudaStream_t>(s))); }
int streamSynchronize(void* s) { return ret(cudaStreamSynchronize(static_cast<cudaStream_t>(s))); }
int eventCreate(void** e) {
  return ret(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(e), cudaEventDisableTiming));
}
int eventDestroy(void* e) { return ret(cudaEventDestroy(static_cast<cudaEvent_t>(e))); }
int eventRecord(void* e, void* s) { return ret(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s))); }
int eventQuery(void* e) { return ret(cudaEventQuery(static_cast<cudaEvent_t>(e))); }
int streamWaitEvent(void* s, void* e) {
  return ret(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0));
}
int memcpyAsync(void* dst, const void* src, size_t bytes, void* s) {
  return ret(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s)));
}

int deviceMalloc(void** p, size_t bytes) { return ret(cudaMalloc(p, bytes)); }
int deviceFree(void* p) { return ret(cudaFree(p)); }
int canAccessPeer(int d, int peer, int* can) {
  if (d == peer) return *can = 1, 0;
  return ret(cudaDeviceCanAccessPeer(can, d, peer));
}
static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "IPC handle size");
static_assert(sizeof(cudaIpcEventHandle_t) == kIpcHandleBytes, "IPC event handle size");
int ipcGetMemHandle(void* h, void* p) { return ret(cudaIpcGetMemHandle(static_cast<cudaIpcMemHandle_t*>(h), p)); }
int ipcOpenMemHandle(void** p, const void* h) {
  cudaIpcMemHandle_t handle;
  memcpy(&handle, h, sizeof(handle));
  return ret(cudaIpcOpenMemHandle(p, handle, cudaIpcMemLazyEnablePeerAccess));
}
int ipcCloseMemHandle(void* p) { return ret(cudaIpcCloseMemHandle(p)); }
int ipcEventCreate(void** e) {
  return ret(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(e), cudaEventDisableTiming | cudaEventInterprocess));
}
int ipcGetEventHandle(void* h, void* e) {
  return ret(cudaIpcGetEventHandle(static_cast<cudaIpcEventHandle_t*>(h), static_cast<cudaEvent_t>(e)));
}
int ipcOpenEventHandle(void** e, const void* h) {
  cudaIpcEventHandle_t handle;
  memcpy(&handle, h, sizeof(handle));
  return ret(cudaIpcOpenEventHandle(reinterpret_cast<cudaEvent_t*>(e), handle));
}

// GPUDirect RDMA. The driver's calls are looked up in the driver library the runtime loaded
// (libcuda.so.1), not through the runtime's entry-point query: the plugin may run under an
// older runtime than the toolkit it was built with (torch's own libcudart), and the query's
// versioned form exists only from CUDA 12.5.
template <typename Fn>
Fn driverCall(const char* symbol) {
  static void* const lib = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return h ? h : dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  }();
  return lib ? reinterpret_cast<Fn>(dlsym(lib, symbol)) : nullptr;
}

int allocationRange(const void* p, void** base, size_t* bytes) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const Fn fn = driverCall<Fn>("cuMemGetAddressRange_v2");
  if (!fn) return static_cast<int>(cudaErrorNotSupported);
  CUdeviceptr b = 0;
  CUresult r = fn(&b, bytes, reinterpret_cast<CUdeviceptr>(p));
  *base = reinterpret_cast<void*>(b);
  return static_cast<int>(r);
}

int dmabufFd(const void* p, size_t bytes, int* fd) {
  using Fn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  static const Fn fn = driverCall<Fn>("cuMemGetHandleForAddressRange");
  *fd = -1;
  if (!fn) return static_cast<int>(cudaErrorNotSupported);
  return static_cast<int>(fn(fd, reinterpret_cast<CUdeviceptr>(p), bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0));
}

int flushRdmaWrites() {
  int device = 0, options = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (!(options & cudaFlushGPUDirectRDMAWritesOptionHost)) return 0;
  return ret(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                                cudaFlushGPUDirectRDMAWritesToOwner));
}

int shot(const ShotArgs* a, DataType t, ShotKind k, int blocks, void* stream) {
  return ret(static_cast<cudaError_t>(shotAsync(*a, t, k, blocks, stream)));
}

int streamCapturing(void* stream, int* capturing) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st);
  *capturing = st != cudaStreamCaptureStatusNone ? 1 : 0;  // active, or invalidated and still open
  return ret(e);
}

int exchangeCaptureMode(int* mode) {
  auto m = static_cast<cudaStreamCaptureMode>(*mode);
  const cudaError_t e = cudaThreadExchangeStreamCaptureMode(&m);
  *mode = static_cast<int>(m);
  return ret(e);
}

// Stream memory operations (the driver's: the runtime has no such call).
int streamWriteValue64(void* s, void* addr, uint64_t v) {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static const Fn fn = driverCall<Fn>("cuStreamWriteValue64_v2");
  if (!fn) return static_cast<int>(cudaErrorNotSupported);
  return static_cast<int>(fn(static_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr), v, CU_STREAM_WRITE_VALUE_DEFAULT));
}

int streamWaitValue64(void* s, void* addr, uint64_t v) {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static const Fn fn = driverCall<Fn>("cuStreamWaitValue64_v2");
  if (!fn) return static_cast<int>(cudaErrorNotSupported);
  return static_cast<int>(fn(static_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr), v, CU_STREAM_WAIT_VALUE_GEQ));
}

#define RAILCC_STR2(x) #x
#define RAILCC_STR(x) RAILCC_STR2(x)

const DeviceApi kApi = {
    kDeviceApiVersion,
    "cuda runtime " RAILCC_STR(CUDART_VERSION),
    static_cast<int>(cudaErrorNotReady),
    errorString,
    deviceCount,
    setDevice,
    getDevice,
    pointerDevice,
    hostAlloc,
    hostFree,
    streamCreate,
    streamDestroy,
    streamSynchronize,
    eventCreate,
    eventDestroy,
    eventRecord,
    eventQuery,
    streamWaitEvent,
    memcpyAsync,
    deviceMalloc,
    deviceFree,
    canAccessPeer,
    ipcGetMemHandle,
    ipcOpenMemHandle,
    ipcCloseMemHandle,
    ipcEventCreate,
    ipcGetEventHandle,
    ipcOpenEventHandle,
    reduceAsync,
    divideAsync,
    scaleCopyAsync,
    allocationRange,
    dmabufFd,
    flushRdmaWrites,
    shot,
    streamCapturing,
    exchangeCaptureMode,
    streamWriteValue64,
    streamWaitValue64,
};

}  // namespace
}  // namespace railcc::cuda

extern "C" __attribute__((visibility("default"))) const railcc::cuda::DeviceApi* railcc_device_api_v1() {
  return &railcc::cuda::kApi;
}
