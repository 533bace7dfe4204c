// attention_with_kvcache (fusedlm/ops/attention_kvcache.py): its schema and its kernels'
// routing. It writes the new keys and values into the caches in place and has no gradient.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "ops/entry.h"
#include "ops/route.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

using Forward = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, double);
constexpr char kOp[] = "fusedlm::attention_with_kvcache";
constexpr char kForwardKernel[] = "attention_with_kvcache_forward";

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("attention_with_kvcache(Tensor q, Tensor(a1!) k_cache, Tensor(a2!) v_cache, "
        "Tensor cache_seqlens, Tensor? k_new, Tensor? v_new, Tensor? cache_leftpad, float scale, "
        "str backend) -> Tensor");
}

FUSEDLM_ROUTE(attention_with_kvcache, kForwardKernel, Forward)

// The caches' versions move on with every write, as for any in-place op.
TORCH_LIBRARY_IMPL(fusedlm, ADInplaceOrView, m) {
  m.impl("attention_with_kvcache", torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}
TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) {
  m.impl("attention_with_kvcache", torch::autograd::autogradNotImplementedFallback());
}

FUSEDLM_ENTRY(attention_with_kvcache, kOp, decltype(Routed<kForwardKernel, Forward>::run));

}  // namespace fusedlm
