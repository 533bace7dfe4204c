// What the emulation build (FUSEDLM_CUDA=emulate) tells Python of its emulator: the GPU it
// acts as, and what each launch moved and computed (emulator/runtime.h's LaunchCount),
// for tests and benchmarks that hold a kernel to its ideal traffic and products.
#if defined(FUSEDLM_EMULATE)
#include <cstdint>
#include <string>
#include <vector>

#include "bind.h"
#include "cuda/runtime.h"

namespace fusedlm::cuda {

// "sm_80" or "sm_90a" (FUSEDLM_EMULATE_ARCH).
std::string emulated_arch() { return emu::arch_name(); }
FUSEDLM_BIND(emulated_arch);

// Starts counting launches (clearing the record) or stops.
void count_launches(bool on) { emu::count_launches(on); }
FUSEDLM_BIND(count_launches, pybind11::arg("on"));

// The launches counted, oldest first: dicts of kernel, grid, block, shared_bytes,
// tensor_core_macs and tensors, a list of (storage address, bytes, read, written).
std::vector<pybind11::dict> counted_launches() {
  std::vector<pybind11::dict> out;
  for (const emu::LaunchCount& c : emu::counted_launches()) {
    pybind11::list tensors;
    for (const emu::TensorTraffic& t : c.tensors)
      tensors.append(pybind11::make_tuple(reinterpret_cast<uintptr_t>(t.storage), t.bytes,
                                          t.read, t.written));
    pybind11::dict d;
    d["kernel"] = c.kernel;
    d["grid"] = pybind11::make_tuple(c.grid.x, c.grid.y, c.grid.z);
    d["block"] = pybind11::make_tuple(c.block.x, c.block.y, c.block.z);
    d["shared_bytes"] = c.shared_bytes;
    d["tensor_core_macs"] = c.tensor_core_macs;
    d["tensors"] = tensors;
    out.push_back(std::move(d));
  }
  return out;
}
FUSEDLM_BIND(counted_launches);

}  // namespace fusedlm::cuda
#endif
