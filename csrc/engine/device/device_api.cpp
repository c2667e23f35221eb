#include "engine/device.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "common/error.h"
#include "common/log.h"

namespace railcc::engine {
namespace {

std::mutex gMu;
const cuda::DeviceApi* gTestApi = nullptr;
const cuda::DeviceApi* gPlugin = nullptr;
std::string gLoadError;  // set once loading failed: later calls fail the same way at once
bool gTried = false;

// The plugin sits beside the shared object this function was linked into.
std::string defaultPluginPath() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&defaultPluginPath), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string self = info.dli_fname;
  auto slash = self.rfind('/');
  return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/librailcc_cuda.so";
}

const cuda::DeviceApi* loadPlugin(std::string& err) {
  const char* env = std::getenv("RAILCC_CUDA_PLUGIN");
  std::string path = env && *env ? env : defaultPluginPath();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    err = "cannot load the CUDA plugin " + path + ": " + (e ? e : "unknown error") +
          " (this railcc build has no CUDA support, or the CUDA runtime library is missing)";
    return nullptr;
  }
  using Fn = const cuda::DeviceApi* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(h, "railcc_device_api_v1"));
  const cuda::DeviceApi* api = fn ? fn() : nullptr;
  if (!api || api->version != cuda::kDeviceApiVersion) {
    err = "the CUDA plugin " + path + " is from another railcc version (rebuild railcc)";
    return nullptr;  // the handle stays open: harmless, and unloading code is never safe
  }
  RAILCC_INFO(INIT, "CUDA plugin loaded from ", path, " (", api->name, ")");
  return api;
}

}  // namespace

const cuda::DeviceApi& deviceApi() {
  std::lock_guard<std::mutex> g(gMu);
  if (gTestApi) return *gTestApi;
  if (!gTried) {
    gTried = true;
    gPlugin = loadPlugin(gLoadError);
    if (gPlugin) installGpuMemory(gPlugin);
  }
  if (!gPlugin) throw Error(ErrorCode::kDevice, gLoadError);
  return *gPlugin;
}

void setDeviceApiForTesting(const cuda::DeviceApi* api) {
  std::lock_guard<std::mutex> g(gMu);
  gTestApi = api;
  installGpuMemory(api ? api : gPlugin);
}

bool deviceApiAvailable(std::string* why) {
  try {
    deviceApi();
    return true;
  } catch (const Error& e) {
    if (why) *why = e.what();
    return false;
  }
}

void checkDevice(int err, const char* call, int device) {
  if (err == 0) return;
  const cuda::DeviceApi& api = deviceApi();
  const char* msg = api.errorString ? api.errorString(err) : nullptr;
  RAILCC_THROW(kDevice, call, " on cuda:", device, " failed: ", msg ? msg : "unknown error", " (error ", err, ")");
}

}  // namespace railcc::engine
