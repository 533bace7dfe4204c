// The switches between the cuda backend's kernel paths: read from the environment when
// first asked for, changed at run time by set_path (tests and benchmarks compare a path
// with the one it replaces, at the same shapes).
#include <cstdlib>
#include <string_view>

#include "cuda/common.h"
#include "bind.h"

namespace fusedlm::cuda {
namespace {

struct Switch {
  const char* name;
  const char* variable;  // "0" turns the path off
  std::atomic<bool> KernelPaths::*enabled;
};

constexpr Switch kSwitches[] = {
    {"attention_resident", "FUSEDLM_ATTENTION_RESIDENT", &KernelPaths::attention_resident},
    {"attention_wgmma", "FUSEDLM_ATTENTION_WGMMA", &KernelPaths::attention_wgmma},
    {"attention_fused_backward", "FUSEDLM_ATTENTION_FUSED_BACKWARD",
     &KernelPaths::attention_fused_backward},
    {"ffn_cublas", "FUSEDLM_FFN_CUBLAS", &KernelPaths::ffn_cublas},
    {"ffn_wgmma", "FUSEDLM_FFN_WGMMA", &KernelPaths::ffn_wgmma},
};

bool on_in_environment(const char* variable) {
  const char* value = std::getenv(variable);
  return value == nullptr || std::string_view(value) != "0";
}

}  // namespace

KernelPaths& kernel_paths() {
  static KernelPaths paths;
  static const bool read = [] {
    for (const Switch& s : kSwitches) (paths.*s.enabled) = on_in_environment(s.variable);
    return true;
  }();
  (void)read;
  return paths;
}

void set_path(const std::string& name, bool enabled) {
  for (const Switch& s : kSwitches)
    if (name == s.name) {
      (kernel_paths().*s.enabled) = enabled;
      return;
    }
  TORCH_CHECK_VALUE(false, "no kernel path is named '", name, "'");
}
FUSEDLM_BIND(set_path, pybind11::arg("name"), pybind11::arg("enabled"));

std::map<std::string, bool> paths() {
  std::map<std::string, bool> out;
  for (const Switch& s : kSwitches) out[s.name] = kernel_paths().*s.enabled;
  return out;
}
FUSEDLM_BIND(paths);

#if !defined(FUSEDLM_EMULATE)
// The CUDA version the installed driver supports (12080 for 12.8): a driver update may
// change what a kernel computes (it JIT-compiles PTX), so the checks at first use record
// it. PyTorch's Python API does not expose it.
int driver_version() {
  int version = 0;
  C10_CUDA_CHECK(cudaDriverGetVersion(&version));
  return version;
}
FUSEDLM_BIND(driver_version);
#endif

}  // namespace fusedlm::cuda
