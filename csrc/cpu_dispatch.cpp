// Picks the instruction set whose CPU kernels run, as ATen picks its own kernels:
// the best instruction set the CPU supports, or a lower one named by the
// FUSEDLM_CPU_CAPABILITY environment variable (baseline, avx2, avx512).
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <mutex>

#include <ATen/Dispatch.h>

#include "bind.h"
#include "common.h"

namespace fusedlm {
namespace {

bool cpu_supports(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == "baseline";
}

cpu::Isa isa_named(const std::string& isa) {
  for (int i = 0; i < int(std::size(cpu::kIsaNames)); ++i)
    if (isa == cpu::kIsaNames[i]) return static_cast<cpu::Isa>(i);
  TORCH_CHECK_VALUE(false, "no instruction set is named '", isa, "'");
}

std::atomic<cpu::Isa> active{cpu::Isa::kBaseline};
std::once_flag chosen;

void choose_default() {
  std::string isa = "baseline";
  for (const char* candidate : {"avx512", "avx2"})
    if (cpu_supports(candidate)) { isa = candidate; break; }
  if (const char* env = std::getenv("FUSEDLM_CPU_CAPABILITY"))
    if (cpu_supports(env)) isa = env;
  active = isa_named(isa);
}

}  // namespace

cpu::Isa cpu::active_isa() {
  std::call_once(chosen, choose_default);
  return active.load(std::memory_order_relaxed);
}

std::string cpu_capability() { return cpu::kIsaNames[static_cast<int>(cpu::active_isa())]; }
FUSEDLM_BIND(cpu_capability);

void set_cpu_capability(const std::string& isa) {
  // Kernels of an instruction set the processor lacks would stop it at their first one.
  TORCH_CHECK_VALUE(cpu_supports(isa), "this processor does not run '", isa, "' kernels");
  cpu::active_isa();
  active = isa_named(isa);
}
FUSEDLM_BIND(set_cpu_capability, pybind11::arg("isa"));

std::vector<std::string> supported_cpu_capabilities() {
  std::vector<std::string> out;
  for (const char* isa : cpu::kIsaNames)
    if (cpu_supports(isa)) out.emplace_back(isa);
  return out;
}
FUSEDLM_BIND(supported_cpu_capabilities);

at::Tensor partial_sums(int64_t rows, int64_t cols, at::ScalarType dtype) {
  constexpr int64_t kScratchBytes = int64_t(1) << 20;
  const auto options = at::TensorOptions().dtype(dtype);
  const int64_t bytes = rows * cols * int64_t(c10::elementSize(dtype));
  if (bytes > kScratchBytes) return at::empty({rows, cols}, options);
  thread_local std::vector<double> scratch;  // doubles: aligned for every dtype
  if (scratch.size() * sizeof(double) < size_t(bytes)) scratch.resize((bytes + 7) / 8);
  return at::from_blob(scratch.data(), {rows, cols}, options);
}

at::Tensor sum_partials(const at::Tensor& partial, int64_t first, int64_t blocks,
                        at::ScalarType dtype) {
  const int64_t cols = partial.size(1);
  auto out = at::empty({cols}, partial.options());
  AT_DISPATCH_FLOATING_TYPES(partial.scalar_type(), "sum_partials", [&] {
    const scalar_t* src = partial.data_ptr<scalar_t>() + first * cols;
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, cols, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) dst[c] = 0;
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t c = begin; c < end; ++c) dst[c] += src[b * cols + c];
    });
  });
  return dtype == out.scalar_type() ? out : out.to(dtype);
}

}  // namespace fusedlm
