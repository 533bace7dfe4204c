"""A patched model works with the rest of PyTorch: autocast, torch.compile, DDP,
state_dict round trips, no_grad and inference_mode; TorchScript is refused, saying so."""
import copy
import io
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fusedlm
from helpers import fresh

D_MODEL, HEADS, D_FF, SEQ = 16, 2, 32, 8


class _Stack(nn.Module):
    def __init__(self, norm_first=False):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D_MODEL),
                                             enable_nested_tensor=False)

    def forward(self, x, padding):
        return self.encoder(x, src_key_padding_mask=padding)


def _model(seed=0, norm_first=False):
    torch.manual_seed(seed)
    return _Stack(norm_first)


def _padding(batch):
    lengths = torch.randint(2, SEQ + 1, (batch,))
    lengths[0] = SEQ
    return torch.arange(SEQ)[None, :] >= lengths[:, None]


def _loss(model, x, padding):
    """Mean over sequences of each one's summed squares over its real tokens: a loss over
    real tokens, and a sum of per-sequence terms, so halves of a batch add up to it."""
    out = model(x, padding)
    return out.masked_fill(padding[..., None], 0).pow(2).sum((1, 2)).mean()


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_bfloat16_autocast_loss_within_1e_2(norm_first):
    model = _model(norm_first=norm_first)
    patched = fusedlm.patch(copy.deepcopy(model))
    x, padding = fresh((4, SEQ, D_MODEL), torch.float32, "cpu"), _padding(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, loss = _loss(model, x, padding), _loss(patched, x, padding)
    assert abs(loss.item() - expected.item()) <= 1e-2
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in patched.parameters())


def test_compile_fullgraph_forward_and_backward():
    model = _model()
    patched = fusedlm.patch(copy.deepcopy(model))
    x, padding = fresh((3, SEQ, D_MODEL), torch.float32, "cpu"), _padding(3)
    torch._dynamo.reset()
    compiled = torch.compile(_loss, fullgraph=True, backend="aot_eager")
    loss = compiled(patched, x, padding)
    loss.backward()
    expected = _loss(model, x, padding)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(patched.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


SCRIPTED = {
    "MultiheadAttention": lambda: fusedlm.nn.MultiheadAttention(D_MODEL, HEADS),
    "LayerNorm": lambda: fusedlm.nn.LayerNorm(D_MODEL),
    "TransformerEncoderLayer": lambda: fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF),
    "TransformerEncoder": lambda: fusedlm.nn.TransformerEncoder(
        fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF), 2),
    "patched model": lambda: fusedlm.patch(_model()),
}


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("module", list(SCRIPTED))
def test_torchscript_is_refused_with_an_error_saying_so(module):
    with pytest.raises(TypeError, match=r"fusedlm\.nn\.\w+ cannot be scripted: fusedlm's modules run "
                                        r"eagerly or under torch\.compile, not as TorchScript"):
        torch.jit.script(SCRIPTED[module]())


def test_state_dict_round_trip_and_no_grad():
    patched = fusedlm.patch(_model(seed=1))
    buffer = io.BytesIO()
    torch.save(patched.state_dict(), buffer)
    buffer.seek(0)
    fresh_model = fusedlm.patch(_model(seed=2))
    fresh_model.load_state_dict(torch.load(buffer))
    unpatched = _model(seed=3)
    unpatched.load_state_dict(patched.state_dict())
    x, padding = fresh((3, SEQ, D_MODEL), torch.float32, "cpu"), _padding(3)
    with torch.no_grad():
        expected = _loss(patched, x, padding)
        torch.testing.assert_close(_loss(fresh_model, x, padding), expected)
        torch.testing.assert_close(_loss(unpatched, x, padding), expected)
    with torch.inference_mode():
        torch.testing.assert_close(_loss(patched, x, padding), expected)


def _ddp_worker(rank, world, init_file, x, padding, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = nn.parallel.DistributedDataParallel(fusedlm.patch(_model()))
    rows = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
    # DDP averages gradients over ranks, as the mean over the full batch does.
    _loss(model, x[rows], padding[rows]).backward()
    if rank == 0:
        torch.save({n: p.grad for n, p in model.module.named_parameters()}, result_file)
    # Both ranks leave together: gloo may abort a process that ends its group while the
    # other is still busy (here rank 0, saving).
    dist.barrier()
    dist.destroy_process_group()


def test_ddp_two_processes_match_one_on_the_full_batch():
    x, padding = fresh((4, SEQ, D_MODEL), torch.float32, "cpu", requires_grad=False), _padding(4)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "grads.pt")
        mp.spawn(_ddp_worker, args=(2, os.path.join(tmp, "init"), x, padding, result), nprocs=2)
        ddp_grads = torch.load(result)
    model = fusedlm.patch(_model())
    _loss(model, x, padding).backward()
    assert ddp_grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ddp_grads[name], p.grad, msg=name)
