#pragma once

// The engine's view of a GPU runtime: a table of plain functions, filled by the CUDA plugin
// (csrc/cuda/plugin.cu, built by nvcc into librailcc_cuda.so and loaded with dlopen only when
// a device buffer first appears). Neither torch nor a CUDA header is needed to use it, so the
// engine and the CPU-only build never link the CUDA runtime.
//
// Every handle is the runtime's own (cudaStream_t, cudaEvent_t) passed as void*. Every
// function returns the runtime's error code, 0 on success; errorString() names it.

#include <cstddef>
#include <cstdint>

#include "common/types.h"

namespace railcc::cuda {

struct ShotArgs;  // cuda/shots.h
enum class ShotKind : uint8_t;

constexpr uint32_t kDeviceApiVersion = 6;
constexpr size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t and cudaIpcEventHandle_t

struct DeviceApi {
  uint32_t version;      // kDeviceApiVersion
  const char* name;      // "cuda 13.0 runtime", or what a test fake calls itself
  int notReady;          // the code eventQuery returns while the event is pending

  const char* (*errorString)(int err);
  int (*deviceCount)(int* n);
  int (*setDevice)(int device);
  int (*getDevice)(int* device);
  /// Device of a pointer: *device = -1 when it is host memory the runtime does not know.
  int (*pointerDevice)(const void* p, int* device);

  int (*hostAlloc)(void** p, size_t bytes);  // pinned host memory
  int (*hostFree)(void* p);
  int (*streamCreate)(void** stream);        // non-blocking with respect to the legacy stream
  int (*streamDestroy)(void* stream);
  int (*streamSynchronize)(void* stream);
  int (*eventCreate)(void** event);          // timing disabled
  int (*eventDestroy)(void* event);
  int (*eventRecord)(void* event, void* stream);
  int (*eventQuery)(void* event);            // 0 done, notReady pending, else an error
  int (*streamWaitEvent)(void* stream, void* event);
  /// Copies between any two of host, pinned host and device memory (unified addressing).
  int (*memcpyAsync)(void* dst, const void* src, size_t bytes, void* stream);

  // Device memory and CUDA IPC, for the cuda_ipc path between processes on one host.
  int (*deviceMalloc)(void** p, size_t bytes);
  int (*deviceFree)(void* p);
  int (*canAccessPeer)(int device, int peerDevice, int* can);
  int (*ipcGetMemHandle)(void* handle, void* devPtr);           // handle: kIpcHandleBytes
  int (*ipcOpenMemHandle)(void** devPtr, const void* handle);   // with lazy peer access
  int (*ipcCloseMemHandle)(void* devPtr);
  int (*ipcEventCreate)(void** event);                          // interprocess, timing disabled
  int (*ipcGetEventHandle)(void* handle, void* event);
  int (*ipcOpenEventHandle)(void** event, const void* handle);

  /// dst[i] = dst[i] (op) (scale * src[i]), the semantics of railcc::reduceInto, as a kernel.
  int (*reduceAsync)(void* dst, const void* src, size_t count, DataType t, ReduceOp op, double scale, void* stream);
  /// buf[i] /= n (floating types): finishes AVG.
  int (*divideAsync)(void* buf, size_t count, DataType t, double n, void* stream);
  /// dst[i] = scale * src[i] (floating types; dst may equal src): PREMUL_SUM's first term.
  int (*scaleCopyAsync)(void* dst, const void* src, size_t count, DataType t, double scale, void* stream);

  // GPUDirect RDMA: device memory registered with a NIC by the verbs transport.
  /// The device allocation holding p (cuMemGetAddressRange): its base and size.
  int (*allocationRange)(const void* p, void** base, size_t* bytes);
  /// A dma-buf file descriptor for [p, p + bytes) of device memory, both aligned to the host
  /// page size (cuMemGetHandleForAddressRange); the caller closes it. Driver errors are
  /// returned as their CUresult, whose common codes are the runtime's.
  int (*dmabufFd)(const void* p, size_t bytes, int* fd);
  /// Makes RDMA writes that landed in the current device's memory visible to its later work
  /// (cudaDeviceFlushGPUDirectRDMAWrites); a no-op where the device needs none.
  int (*flushRdmaWrites)();

  /// One collective in one kernel (cuda/shot_kernels.h) through the peers' scratch named by
  /// args->peers, `blocks` blocks (the same on every rank).
  int (*shotAsync)(const ShotArgs* args, DataType t, ShotKind kind, int blocks, void* stream);

  // CUDA graphs.
  /// *capturing = 1 while `stream` is being captured into a graph (cudaStreamIsCapturing).
  int (*streamCapturing)(void* stream, int* capturing);
  /// Swaps the calling thread's capture mode (cudaThreadExchangeStreamCaptureMode; 0 global, 1
  /// thread-local, 2 relaxed): railcc's own calls that may synchronize (event queries, set-up)
  /// run relaxed, so they neither fail nor break a capture that another thread began.
  int (*exchangeCaptureMode)(int* mode);

  // Stream memory operations (cuStreamWriteValue64, cuStreamWaitValue64): signals between the
  // ranks' streams with no kernel and no host in between (RAILCC_CUDA_IPC_SIGNALS).
  /// Once the stream's earlier work is done and visible, *addr = v (device memory, a peer's too).
  int (*streamWriteValue64)(void* stream, void* addr, uint64_t v);
  /// The stream's later work waits until *addr >= v (unsigned).
  int (*streamWaitValue64)(void* stream, void* addr, uint64_t v);
};

}  // namespace railcc::cuda

/// The plugin's one exported symbol.
extern "C" const railcc::cuda::DeviceApi* railcc_device_api_v1();
