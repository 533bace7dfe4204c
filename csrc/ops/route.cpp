#include "ops/route.h"

#include <map>
#include <memory>
#include <mutex>

namespace fusedlm {
namespace {

constexpr const char* kBackendNames[kBackends] = {"reference", "cpu", "triton", "cuda"};

// Filled while the extension loads (the compiled kernels) and by fusedlm.backends; read on
// every call through the references handed out, which stay valid.
std::mutex& slots_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<std::string, std::unique_ptr<KernelSlots>>& all_slots() {
  static auto* slots = new std::map<std::string, std::unique_ptr<KernelSlots>>();  // (kept past exit)
  return *slots;
}

}  // namespace

int backend_index(c10::string_view name) {
  for (int i = 0; i < kBackends; ++i)
    if (name == kBackendNames[i]) return i;
  TORCH_CHECK_VALUE(false, "backend must be one of reference, cpu, triton or cuda, got '", name, "'");
}

KernelSlots& kernel_slots(const std::string& name) {
  std::lock_guard<std::mutex> lock(slots_mutex());
  auto& slots = all_slots()[name];
  if (!slots) slots = std::make_unique<KernelSlots>();
  return *slots;
}

CompiledKernel::CompiledKernel(const char* name, const char* backend, void* function,
                               const std::type_info& type) {
  auto& slots = kernel_slots(name);
  const int b = backend_index(backend);
  slots.compiled[b] = function;
  slots.types[b] = &type;
}

// Makes `function` (None: none, the compiled kernel again) backend's kernel `name`.
void set_python_kernel(const std::string& name, const std::string& backend, pybind11::object function) {
  auto& slots = kernel_slots(name);
  PyObject* kept = nullptr;
  if (!function.is_none()) kept = function.release().ptr();  // (never released: see KernelSlots)
  slots.python[backend_index(backend)].store(kept, std::memory_order_release);
}
FUSEDLM_BIND(set_python_kernel, pybind11::arg("name"), pybind11::arg("backend"), pybind11::arg("function"));

}  // namespace fusedlm
