"""unpad and pad against the reference, on every backend that has them."""
import pytest
import torch

import fusedlm
import fuzz
from fusedlm.ops import reference
from fuzz import Case
from helpers import backend_device, backends_for, fresh, gpu_test


def _mask(batch, seq, device):
    """Random padding (True), including a row of nothing but padding and a row of none."""
    mask = torch.rand(batch, seq, device=device) < 0.4
    mask[0] = True
    mask[-1] = False
    return mask


@pytest.mark.parametrize("backend", backends_for("unpad"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("features", [(), (24,), (3, 8)])
def test_unpad_and_pad_match_reference(backend, dtype, features):
    device = backend_device(backend)
    mask = _mask(4, 13, device)
    hidden = (torch.randn(4, 13, *features, device=device) * 100).to(dtype)
    packed, indices, cu_seqlens, max_seqlen = fusedlm.ops.unpad(hidden, mask, backend=backend)
    expected = reference.unpad(hidden, mask)
    assert torch.equal(packed, expected[0])
    assert torch.equal(indices, expected[1]) and indices.dtype == torch.int64
    assert torch.equal(cu_seqlens, expected[2]) and cu_seqlens.dtype == torch.int32
    assert type(max_seqlen) is int and max_seqlen == expected[3]
    padded = fusedlm.ops.pad(packed, indices, 4, 13, backend=backend)
    assert torch.equal(padded, reference.pad(packed, indices, 4, 13))
    assert torch.equal(padded, hidden.masked_fill(mask.view(4, 13, *[1] * len(features)), 0))


@pytest.mark.parametrize("backend", backends_for("pad"))
def test_unpad_and_pad_outputs_are_not_views(backend):
    # FSDP2 warns about, and cannot follow in-place changes to, a view a module returns.
    device = backend_device(backend)
    hidden = fresh((3, 10, 2, 4), torch.float32, device)
    with torch.no_grad():
        packed, indices, cu_seqlens, _ = torch.ops.fusedlm.unpad(hidden, _mask(3, 10, device),
                                                                 backend)
        padded = torch.ops.fusedlm.pad(packed, indices, 3, 10, backend)
        dpacked = torch.ops.fusedlm.pad_backward(torch.randn_like(padded), indices, backend)
    assert [t._base is None for t in (packed, indices, cu_seqlens, padded, dpacked)] == [True] * 5


@pytest.mark.parametrize("backend", backends_for("pad"))
def test_unpad_and_pad_gradients(backend):
    device = backend_device(backend)
    mask = _mask(3, 10, device)
    hidden = fresh((3, 10, 6), torch.float32, device)
    packed, indices, _, _ = fusedlm.ops.unpad(hidden, mask, backend=backend)
    grad = torch.randn_like(packed)
    (dhidden,) = torch.autograd.grad(packed, hidden, grad)
    # unpad's gradient scatters back, zeros at the padding.
    assert torch.equal(dhidden, reference.pad(grad, indices, 3, 10))

    leaf = fresh((indices.numel(), 6), torch.float32, device)
    out = fusedlm.ops.pad(leaf, indices, 3, 10, backend=backend)
    grad_out = torch.randn_like(out)
    (dleaf,) = torch.autograd.grad(out, leaf, grad_out)
    # pad's gradient gathers the rows it placed.
    assert torch.equal(dleaf, grad_out.flatten(0, 1)[indices])


def test_unpad_gradcheck():
    mask = _mask(2, 5, "cpu")
    hidden = fresh((2, 5, 3), torch.float64, "cpu")
    assert torch.autograd.gradcheck(lambda h: fusedlm.ops.unpad(h, mask, backend="cpu")[0], (hidden,))
    indices = fusedlm.ops.unpad(hidden, mask, backend="cpu")[1]
    packed = fresh((indices.numel(), 3), torch.float64, "cpu")
    assert torch.autograd.gradcheck(lambda p: fusedlm.ops.pad(p, indices, 2, 5, backend="cpu"), (packed,))


def test_unpad_reads_strided_hidden_and_masks():
    # A transposed hidden (features not contiguous) and a transposed mask.
    hidden = torch.randn(7, 12, 5).transpose(0, 1)  # [12, 7, 5], rows strided
    mask = (torch.rand(7, 12) < 0.5).t()
    packed, indices, cu_seqlens, max_seqlen = fusedlm.ops.unpad(hidden, mask, backend="cpu")
    expected = reference.unpad(hidden, mask)
    assert torch.equal(packed, expected[0]) and torch.equal(indices, expected[1])
    assert torch.equal(cu_seqlens, expected[2]) and max_seqlen == expected[3]
    features_strided = torch.randn(12, 7, 10)[..., ::2]
    assert torch.equal(fusedlm.ops.unpad(features_strided, mask, backend="cpu")[0],
                       reference.unpad(features_strided, mask)[0])


def test_unpad_everything_padding():
    hidden = torch.randn(3, 4, 2)
    packed, indices, cu_seqlens, max_seqlen = fusedlm.ops.unpad(hidden, torch.ones(3, 4, dtype=torch.bool),
                                                                backend="cpu")
    assert packed.shape == (0, 2) and indices.shape == (0,) and max_seqlen == 0
    assert torch.equal(cu_seqlens, torch.zeros(4, dtype=torch.int32))
    assert torch.equal(fusedlm.ops.pad(packed, indices, 3, 4, backend="cpu"), torch.zeros(3, 4, 2))


def test_unpad_compiles_with_unbacked_sizes():
    mask = _mask(3, 9, "cpu")
    hidden = fresh((3, 9, 4), torch.float32, "cpu")

    def roundtrip(h):
        packed, indices, cu_seqlens, max_seqlen = fusedlm.ops.unpad(h, mask, backend="cpu")
        return fusedlm.ops.pad(packed * 3, indices, 3, 9, backend="cpu"), cu_seqlens, max_seqlen

    out, cu_seqlens, max_seqlen = torch.compile(roundtrip, fullgraph=True)(hidden)
    assert torch.equal(out, 3 * hidden.detach().masked_fill(mask[..., None], 0))
    assert torch.equal(cu_seqlens, reference.unpad(hidden, mask)[2])
    assert max_seqlen == reference.unpad(hidden, mask)[3]
    (grad,) = torch.autograd.grad(out.sum(), hidden)
    assert torch.equal(grad, (~mask[..., None]).float().expand_as(hidden) * 3)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_pad_rejects_bad_input(backend):
    packed = torch.randn(4, 3)
    with pytest.raises(ValueError, match="indices"):
        fusedlm.ops.pad(packed, torch.tensor([0, 1, 2]), 2, 3, backend=backend)
    with pytest.raises(TypeError, match="indices"):
        fusedlm.ops.pad(packed, torch.tensor([0, 1, 2, 3], dtype=torch.int32), 2, 3, backend=backend)
    with pytest.raises(ValueError, match="indices"):
        fusedlm.ops.pad(packed, torch.tensor([0, 1, 2, 6]), 2, 3, backend=backend)
    with pytest.raises(ValueError, match="indices"):
        fusedlm.ops.pad(packed, torch.tensor([0, 1, 1, 2]), 2, 3, backend=backend)
    with pytest.raises(ValueError, match="seqlen"):
        fusedlm.ops.pad(packed, torch.tensor([0, 1, 2, 3]), 2, -3, backend=backend)


def test_unpad_rejects_bad_input():
    hidden = torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match="key_padding_mask"):
        fusedlm.ops.unpad(hidden, torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        fusedlm.ops.unpad(hidden, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="hidden"):
        fusedlm.ops.unpad(hidden[0, 0], torch.zeros(2, 5, dtype=torch.bool))


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

def draw_unpad(d):
    dtype = d.dtype()
    batch, seq = d.size(0, 5, (1,)), d.size(0, 40, (1, 31, 32, 33))
    features = tuple(d.size(1, 9) for _ in range(d.size(0, 2)))
    d.tensor("hidden", (batch, seq, *features), dtype)
    padding = torch.rand(batch, seq, generator=d.generator) < d.choice([0.0, 0.4, 1.0])
    d.index_tensor("key_padding_mask", padding, ("contiguous", "strided", "transposed"))

    def reference_(t):
        keep = ~t["key_padding_mask"]
        lengths = keep.sum(dim=1)
        indices = keep.flatten().nonzero().flatten()
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        max_seqlen = lengths.max() if batch else lengths.new_zeros(())
        return t["hidden"].flatten(0, 1)[indices], indices, cu_seqlens, max_seqlen

    def outputs(result, t):
        packed, indices, cu_seqlens, max_seqlen = result
        return packed, indices, cu_seqlens, torch.tensor(max_seqlen)

    return Case("unpad", f"unpad {dtype}", lambda t: ((t["hidden"], t["key_padding_mask"]), {}),
                reference_, floors=(fuzz.POINTWISE,) * 4, grad_floor=fuzz.POINTWISE, dtype=dtype,
                outputs=outputs, bad=(fuzz.grown("key_padding_mask", 1),), any_dtype=("hidden",))


def draw_pad(d):
    dtype = d.dtype()
    batch, seq = d.size(0, 5, (1,)), d.size(0, 40, (1, 32))
    features = tuple(d.size(1, 9) for _ in range(d.size(0, 2)))
    slots = torch.randperm(batch * seq, generator=d.generator)
    tokens = d.size(0, batch * seq)
    d.tensor("packed", (tokens, *features), dtype)
    d.index_tensor("indices", slots[:tokens])

    def reference_(t):
        out = t["packed"].new_zeros((batch * seq, *features))
        out = out.index_add(0, t["indices"], t["packed"])
        return (out.view(batch, seq, *features),)

    bad = [fuzz.grown("indices", 0)]
    if tokens:
        out_of_range = slots[:tokens].clone()
        out_of_range[0] = batch * seq
        bad.append(fuzz.replaced("indices", out_of_range, "an index past batch * seqlen"))
    return Case("pad", f"pad {dtype} batch={batch} seqlen={seq}",
                lambda t: ((t["packed"], t["indices"], batch, seq), {}), reference_,
                floors=(fuzz.POINTWISE,), grad_floor=fuzz.POINTWISE, dtype=dtype, bad=tuple(bad),
                any_dtype=("packed",))


test_fuzz_unpad, test_fuzz_unpad_bad_inputs = fuzz.tests(draw_unpad, backends_for("unpad"))


test_fuzz_pad, test_fuzz_pad_bad_inputs = fuzz.tests(draw_pad, backends_for("pad"))


@gpu_test
def test_unpad_on_a_gpu_bounds_max_seqlen_by_the_padded_length_without_reading_it_back():
    # The longest length would be read back from the device, a synchronisation per forward:
    # on a GPU max_seqlen is the padded length, a bound attention_varlen takes.
    hidden = torch.randn(2, 6, 8, device="cuda")
    mask = torch.tensor([[False] * 3 + [True] * 3, [False] * 2 + [True] * 4], device="cuda")
    packed, indices, cu_seqlens, max_seqlen = fusedlm.ops.unpad(hidden, mask)
    assert max_seqlen == 6 and cu_seqlens.tolist() == [0, 3, 5]
    assert torch.equal(packed, hidden.flatten(0, 1)[indices])
    # On the CPU it stays the longest.
    assert fusedlm.ops.unpad(hidden.cpu(), mask.cpu())[3] == 3


def test_a_batch_without_padding_is_packed_only_where_reading_that_would_synchronise():
    # fusedlm.nn.padding_of: on the CPU a mask without padding skips packing; on a GPU the
    # check would read the mask back, so every masked batch is packed (the same result).
    from fusedlm.nn import padding_of
    assert padding_of(torch.ones(2, 4, dtype=torch.long)) is None
    assert padding_of(torch.ones(2, 4, dtype=torch.long, device="meta")) is not None
