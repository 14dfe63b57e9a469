// A stand-in for the CUDA runtime library (libcudart) that the host side of fastmha's CUDA kernels links
// against in the launch test. It runs no kernel; it records each launch and enforces the rules a real GPU
// does, so that a launch the hardware would refuse fails here too:
//  - dynamic shared memory above 48 KiB needs cudaFuncSetAttribute(MaxDynamicSharedMemorySize) raised first
//    for *that* kernel on that device, and never above the device's opt-in limit;
//  - at most 1024 threads per block; grid.x below 2^31, grid.y and grid.z at most 65535;
//  - a kernel whose fat binary holds neither SASS the device runs (same major arch, minor not above the
//    device's) nor PTX of an arch not above the device's fails with "no kernel image".
// The device (one, index 0) is set by fastmha_standin_configure() before the first launch; the fat binaries
// the program registers at start-up are parsed for their SASS and PTX archs.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace {

constexpr size_t kDefaultDynamicShared = 48 * 1024;

struct Module {
  std::set<int> sass, ptx;  // archs as 10 * major + minor
};

struct Kernel {
  const Module* module = nullptr;
  std::string name;
  size_t max_dynamic_shared = kDefaultDynamicShared;  // the attribute, on device 0
};

struct LaunchConfig {
  dim3 grid, block;
  size_t shared;
  void* stream;
};

struct Runtime {
  std::mutex mutex;
  std::vector<Module*> modules;
  std::map<const void*, Kernel> kernels;
  std::vector<LaunchConfig> pending;  // __cudaPushCallConfiguration .. __cudaPopCallConfiguration
  cudaError_t last_error = cudaSuccess;
  int sm = 90;
  size_t optin_shared = 227 * 1024;
  int launches = 0;
};

Runtime& runtime() {
  static Runtime* instance = new Runtime;  // never destroyed: modules unregister at exit
  return *instance;
}

cudaError_t fail(Runtime& rt, cudaError_t error) {
  rt.last_error = error;
  return error;
}

// The fat binary: a header (magic 0xBA55ED50, its size at byte 6, the size of what follows at byte 8), then
// entries, each a header (kind at byte 0: 1 PTX, 2 SASS; its size at byte 4; the payload size at byte 8; the
// arch at byte 28) followed by its payload.
void parse_fat_binary(const unsigned char* data, Module& module) {
  uint32_t magic;
  std::memcpy(&magic, data, 4);
  if (magic != 0xBA55ED50u) {
    return;
  }
  uint16_t header_size;
  uint64_t total;
  std::memcpy(&header_size, data + 6, 2);
  std::memcpy(&total, data + 8, 8);
  const unsigned char* entry = data + header_size;
  const unsigned char* end = entry + total;
  while (entry < end) {
    uint16_t kind;
    uint32_t entry_header, arch;
    uint64_t payload;
    std::memcpy(&kind, entry, 2);
    std::memcpy(&entry_header, entry + 4, 4);
    std::memcpy(&payload, entry + 8, 8);
    std::memcpy(&arch, entry + 28, 4);
    (kind == 1 ? module.ptx : module.sass).insert(static_cast<int>(arch));
    entry += entry_header + payload;
  }
}

bool has_image(const Runtime& rt, const Kernel& kernel) {
  for (const int arch : kernel.module->sass) {
    if (arch / 10 == rt.sm / 10 && arch <= rt.sm) {
      return true;
    }
  }
  for (const int arch : kernel.module->ptx) {
    if (arch <= rt.sm) {
      return true;
    }
  }
  return false;
}

// The registered kernel of `function` if the device can run it; otherwise records and returns the error.
cudaError_t runnable_kernel(Runtime& rt, const void* function, Kernel** kernel) {
  const auto found = rt.kernels.find(function);
  if (found == rt.kernels.end()) {
    return fail(rt, cudaErrorInvalidDeviceFunction);
  }
  if (!has_image(rt, found->second)) {
    return fail(rt, cudaErrorNoKernelImageForDevice);
  }
  *kernel = &found->second;
  return cudaSuccess;
}

}  // namespace

// ---- control and inspection, for the test ----

extern "C" void fastmha_standin_configure(int sm, size_t optin_shared) {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  rt.sm = sm;
  rt.optin_shared = optin_shared;
}

extern "C" int fastmha_standin_launches() { return runtime().launches; }

extern "C" void fastmha_standin_archs(std::set<int>* sass, std::set<int>* ptx) {
  auto& rt = runtime();
  for (const Module* module : rt.modules) {
    sass->insert(module->sass.begin(), module->sass.end());
    ptx->insert(module->ptx.begin(), module->ptx.end());
  }
}

// ---- what nvcc's generated host code calls ----

extern "C" void** __cudaRegisterFatBinary(void* fat_cubin) {
  auto& rt = runtime();
  auto* module = new Module;
  struct Wrapper {
    int magic, version;
    const unsigned long long* data;
    void* filename_or_fatbins;
  };
  const auto* wrapper = static_cast<const Wrapper*>(fat_cubin);
  if (wrapper != nullptr && wrapper->data != nullptr) {
    parse_fat_binary(reinterpret_cast<const unsigned char*>(wrapper->data), *module);
  }
  std::lock_guard<std::mutex> lock(rt.mutex);
  rt.modules.push_back(module);
  return reinterpret_cast<void**>(module);
}

extern "C" void __cudaRegisterFatBinaryEnd(void** /*handle*/) {}

extern "C" void __cudaUnregisterFatBinary(void** /*handle*/) {}

extern "C" void __cudaRegisterFunction(void** handle, const char* host_function, char* /*device_function*/,
                                       const char* device_name, int /*thread_limit*/, uint3* /*tid*/, uint3* /*bid*/,
                                       dim3* /*block*/, dim3* /*grid*/, int* /*warp_size*/) {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  Kernel kernel;
  kernel.module = reinterpret_cast<const Module*>(handle);
  kernel.name = device_name;
  rt.kernels[host_function] = kernel;
}

extern "C" unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, void* stream) {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  rt.pending.push_back({grid, block, shared, stream});
  return 0;
}

extern "C" cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shared, void* stream) {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  if (rt.pending.empty()) {
    return fail(rt, cudaErrorInvalidConfiguration);
  }
  const auto config = rt.pending.back();
  rt.pending.pop_back();
  *grid = config.grid;
  *block = config.block;
  *shared = config.shared;
  *static_cast<void**>(stream) = config.stream;
  return cudaSuccess;
}

cudaError_t cudaLaunchKernel(const void* function, dim3 grid, dim3 block, void** /*args*/, size_t shared,
                             cudaStream_t /*stream*/) {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  Kernel* kernel = nullptr;
  if (const auto error = runnable_kernel(rt, function, &kernel); error != cudaSuccess) {
    return error;
  }
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
    return fail(rt, cudaErrorInvalidConfiguration);
  }
  if (shared > kernel->max_dynamic_shared) {
    return fail(rt, cudaErrorInvalidValue);  // what a real launch says: "invalid argument"
  }
  ++rt.launches;
  return cudaSuccess;
}

// CUDA 13's generated launch code looks a kernel's handle up once, then launches through it; the stand-in's
// handle is the kernel's host function.
extern "C" cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* function) {
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(function));
  return cudaSuccess;
}

extern "C" cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t shared,
                                          cudaStream_t stream) {
  return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, args, shared, stream);
}

cudaError_t cudaFuncSetAttribute(const void* function, cudaFuncAttribute attribute, int value) {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  Kernel* kernel = nullptr;
  if (const auto error = runnable_kernel(rt, function, &kernel); error != cudaSuccess) {
    return error;
  }
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > rt.optin_shared) {
      return fail(rt, cudaErrorInvalidValue);
    }
    kernel->max_dynamic_shared = static_cast<size_t>(value);
  }
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void* function) {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  Kernel* kernel = nullptr;
  if (const auto error = runnable_kernel(rt, function, &kernel); error != cudaSuccess) {
    return error;
  }
  std::memset(attributes, 0, sizeof(*attributes));
  attributes->maxDynamicSharedSizeBytes = static_cast<int>(kernel->max_dynamic_shared);
  attributes->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  const auto error = rt.last_error;
  rt.last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError() { return runtime().last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction:
      return "invalid device function";
    case cudaErrorNoKernelImageForDevice:
      return "no kernel image is available for execution on the device";
    default:
      return "unknown error";
  }
}
