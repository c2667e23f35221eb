#pragma once
// How an op on device buffers is described to the device layer (device/staging.cpp,
// device/cuda_ipc.cpp), once per op by its Communicator method: its buffers as staging copies
// them, the host algorithm that runs on the staged copies, and its CUDA IPC form, which works on
// the device buffers in place. Data only; DeviceLayer::runDevice() picks the form.

#include <cstddef>
#include <functional>
#include <utility>
#include <vector>

namespace railcc::engine {

/// A device op's stream and device, set up once per op (DeviceLayer::beginDevice).
struct DeviceOp {
  int device;
  void* stream;
  bool queued = false;    // Placement::queued, with a caller's stream
  bool captured = false;  // the stream is being captured into a CUDA graph (beginDevice)
};

/// One buffer of a device op, staged chunk by chunk through pinned host memory: the copy to host
/// of chunk k+1 and the copy back of chunk k-1 overlap the network part of chunk k. Regions with
/// the same address are staged once (in-place ops).
struct Region {
  char* dev;
  size_t count;  // elements
  bool in, out;  // copied to host before / back to the device after
  static Region input(char* p, size_t n) { return {p, n, true, false}; }
  static Region output(char* p, size_t n) { return {p, n, false, true}; }
  static Region inOut(char* p, size_t n) { return {p, n, true, true}; }
};

/// The host algorithm on the staged copies of the regions (a chunk's host pointers and counts).
using StagedBody = std::function<void(const std::vector<char*>& host, const std::vector<size_t>& counts)>;

struct DevicePlan {
  std::vector<Region> regions;
  size_t slots = 0;    // the most regions any rank passes, so every rank cuts the same chunks
  bool agree = false;  // agree on the largest region first (alltoall: splits differ per rank)
  StagedBody host;
  std::function<void(const DeviceOp&)> ipc;
  /// The plan of an op on one buffer.
  static DevicePlan of(Region r, StagedBody host, std::function<void(const DeviceOp&)> ipc) {
    DevicePlan p;
    p.regions = {r};
    p.slots = 1;
    p.host = std::move(host);
    p.ipc = std::move(ipc);
    return p;
  }
};

}  // namespace railcc::engine
