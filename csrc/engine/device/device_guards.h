#pragma once
// Small scopes for device calls made off the op's path (the watchdog's thread, a segment's
// watcher, the allocator's hook): the capture mode relaxed, the group's device current.

#include "cuda/device_api.h"

namespace railcc::engine {

// While it lives, the calling thread's CUDA capture mode is relaxed (cuda/device_api.h
// exchangeCaptureMode): railcc's calls that may synchronize neither fail nor invalidate a
// graph capture that another thread began in torch's default (global) mode.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(const cuda::DeviceApi& api) : api_(api) {
    swapped_ = api_.exchangeCaptureMode && api_.exchangeCaptureMode(&mode_) == 0;
  }
  ~RelaxedCapture() {
    if (swapped_) api_.exchangeCaptureMode(&mode_);
  }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  const cuda::DeviceApi& api_;
  int mode_ = 2;  // relaxed, then what it was
  bool swapped_ = false;
};

// While it lives, `device` (when >= 0) is the calling thread's current device; with `restore`,
// the one before is put back after. Never throws: error() is setDevice's answer (0 where none
// was needed), for the op's own calls to fail on (gpu_direct.cpp); threads off the op's path
// (the watchdog's, a segment's watcher) go on without it.
class DeviceScope {
 public:
  DeviceScope(const cuda::DeviceApi& api, int device, bool restore = true) : api_(api) {
    if (device < 0 || !api_.setDevice) return;
    int cur = -1;
    if (!api_.getDevice || api_.getDevice(&cur) != 0) cur = -1;
    if (cur == device) return;
    error_ = api_.setDevice(device);
    if (error_ == 0 && restore) was_ = cur;
  }
  ~DeviceScope() {
    if (was_ >= 0) api_.setDevice(was_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  int error() const { return error_; }

 private:
  const cuda::DeviceApi& api_;
  int was_ = -1;
  int error_ = 0;
};

}  // namespace railcc::engine
