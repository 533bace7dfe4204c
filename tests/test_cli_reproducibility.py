"""Runs that repeat: two `fusedlm pretrain` runs with one seed, each in a process of its
own, log the same losses and write the same tokenizer and weights, bit for bit; so does a
run killed with SIGKILL and resumed from its checkpoint. The random generators a
checkpoint keeps come back as they were. The fused CPU kernels give the same bits on any
number of threads; under torch.use_deterministic_algorithms the Triton kernels run a fixed
configuration instead of the one timed fastest."""
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from cli_helpers import TINY, run_cli, run_cli_process, start_cli, write_corpus
import fusedlm.ops as F
from fusedlm.cli import checkpoint, registry, rng
from fusedlm.cli.train import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

# BERT (a trained WordPiece vocabulary, dynamic masking, dropout on), two micro-batches a
# step, and records every other step while checkpoints come every third: a resumed run
# must carry the steps not yet logged.
STEPS = 8


def pretrain_argv(corpus, out, seed=3):
    return ["pretrain", "--model", "bert", "--corpus", corpus, "--steps", STEPS, "--seed", seed,
            "--save-every", 3, "--grad-accum", 2, "--out", out, *TINY[:-2], "--log-every", 2]


def records(out) -> list:
    """(step, loss, learning rate) of each metrics record."""
    return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(out / "metrics.jsonl")]


def assert_same_weights(out, expect):
    spec = registry.SPECS["bert"]
    weights = spec.load_checkpoint(checkpoint.latest(expect)).state_dict()
    for key, value in spec.load_checkpoint(checkpoint.latest(out)).state_dict().items():
        assert torch.equal(value, weights[key]), key


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """A run in a process of its own, never stopped."""
    out = tmp_path_factory.mktemp("straight") / "bert"
    code, _, err = run_cli_process(*pretrain_argv(corpus, out))
    assert code == 0, err[-3000:]
    assert [step for step, _, _ in records(out)] == list(range(2, STEPS + 1, 2))
    return out


@pytest.mark.slow  # processes of their own
def test_two_runs_with_one_seed_are_the_same_run(tmp_path, corpus, straight):
    out = tmp_path / "again"
    code, _, err = run_cli_process(*pretrain_argv(corpus, out))
    assert code == 0, err[-3000:]
    assert records(out) == records(straight)
    # The vocabulary trained on the corpus too, though the processes hash differently.
    assert (out / "tokenizer.json").read_bytes() == (straight / "tokenizer.json").read_bytes()
    assert_same_weights(out, straight)


def test_the_seed_decides_the_run(capsys, tmp_path, corpus, straight):
    argv = pretrain_argv(corpus, tmp_path / "other", seed=4)
    argv[argv.index("--steps") + 1] = 2
    assert run_cli(capsys, *argv)[0] == 0
    assert records(tmp_path / "other")[0][1] != records(straight)[0][1]


def test_deterministic_algorithms_change_nothing_on_the_cpu(capsys, tmp_path, corpus, straight):
    # The fused CPU kernels sum in one order in any mode; --deterministic (kept by the
    # checkpoint) holds for the run alone. Run here, in a process that has run other tests.
    out = tmp_path / "deterministic"
    assert run_cli(capsys, *pretrain_argv(corpus, out), "--deterministic")[0] == 0
    assert records(out) == records(straight)
    assert checkpoint.load_state(checkpoint.latest(out))["settings"]["deterministic"]
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.slow  # processes of their own
def test_a_killed_run_resumes_into_the_same_run(tmp_path, corpus, straight):
    out = tmp_path / "killed"
    process = start_cli(*pretrain_argv(corpus, out))
    while checkpoint.latest(out) is None:
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    saved = checkpoint.load_state(checkpoint.latest(out))["step"]
    assert saved < STEPS
    # What a kill in the middle of a save leaves, which the next save removes.
    leftover = out / f".checkpoint-{saved + 3}.x1y2z3"
    leftover.mkdir(exist_ok=True)
    (leftover / "model.safetensors").write_bytes(b"half a file")

    code, _, err = run_cli_process("pretrain", "--resume", "--out", out, "--log-every", 2,
                                   "--device", "cpu")
    assert code == 0, err[-3000:]
    assert records(out) == records(straight)
    assert_same_weights(out, straight)
    assert not leftover.exists()


def draws() -> tuple:
    return torch.rand(2).tolist(), random.random(), np.random.rand()


def test_the_generators_are_seeded_saved_and_restored(tmp_path):
    device = torch.device("cpu")
    rng.seed(5)
    torch.save(rng.state(device), tmp_path / "state.pt")
    expect = draws()
    rng.seed(6)
    assert all(a != b for a, b in zip(draws(), expect))
    rng.restore(torch.load(tmp_path / "state.pt", weights_only=True), device)
    with rng.untouched(device):  # as a checkpoint is saved
        draws()
    assert draws() == expect


# --- the kernels' configurations under deterministic mode ---------------------------------------

@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _randn(g, *shape):
    return torch.randn(shape, generator=g).requires_grad_()


def _with_gradients(g, outputs, inputs) -> list:
    """The outputs, then the inputs' gradients from random upstream gradients."""
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    torch.autograd.backward(outputs, [torch.randn(o.shape, generator=g) for o in outputs])
    return outputs + [x.grad for x in inputs]


def _attention(g):
    q, k, v = (_randn(g, 4, 4, 200, 32) for _ in range(3))
    bias = _randn(g, 1, 4, 200, 200)  # shared by the sequences: its gradient sums over them
    padding = torch.arange(200) >= torch.tensor([[200], [150], [90], [33]])
    return _with_gradients(g, F.attention(q, k, v, key_padding_mask=padding, attn_bias=bias,
                                          dropout_p=0.1, backend="cpu"), [q, k, v, bias])


def _add_layer_norm(g):
    inputs = [_randn(g, 3000, 256), _randn(g, 3000, 256), _randn(g, 256), _randn(g, 256)]
    return _with_gradients(g, F.add_layer_norm(*inputs, dropout_p=0.1, backend="cpu"), inputs)


def _bias_gelu(g):
    inputs = [_randn(g, 3000, 512), _randn(g, 512)]
    return _with_gradients(g, F.bias_gelu(*inputs, backend="cpu"), inputs)


def _gelu_ffn(g):
    inputs = [_randn(g, 512, 128), _randn(g, 512, 128), _randn(g, 512), _randn(g, 128, 512),
              _randn(g, 128)]
    return _with_gradients(g, F.gelu_ffn(*inputs, dropout_p=0.1, backend="cpu"), inputs)


def _cross_entropy(g):
    logits, labels = _randn(g, 2000, 1000), torch.randint(0, 1000, (2000,), generator=g)
    return _with_gradients(g, F.cross_entropy(logits, labels, label_smoothing=0.1,
                                              backend="cpu"), [logits])


def _masked_lm_loss(g):
    inputs = [_randn(g, 2000, 128), _randn(g, 3000, 128), _randn(g, 3000)]
    labels = torch.randint(0, 3000, (2000,), generator=g)
    labels[torch.rand(2000, generator=g) < 0.85] = -100
    return _with_gradients(g, F.masked_lm_loss(*inputs, labels, backend="cpu"), inputs)


def _distillation_loss(g):
    student, teacher = _randn(g, 2000, 1000), torch.randn(2000, 1000, generator=g)
    return _with_gradients(g, F.distillation_loss(student, teacher, backend="cpu"), [student])


@pytest.mark.parametrize("op", [_attention, _add_layer_norm, _bias_gelu, _gelu_ffn,
                                _cross_entropy, _masked_lm_loss, _distillation_loss],
                         ids=lambda op: op.__name__[1:])
def test_cpu_kernels_sum_in_one_order_on_any_number_of_threads(deterministic, op):
    # Inputs that span several of the kernels' blocks of rows and attention's tasks, run on
    # one thread, then twice on two (taking the tasks in whatever order they finish).
    def run(threads):
        torch.set_num_threads(threads)
        torch.manual_seed(0)  # the dropout seeds
        return op(torch.Generator().manual_seed(1))

    one, two, again = run(1), run(2), run(2)
    for i, (a, b, c) in enumerate(zip(one, two, again)):
        assert torch.equal(a, b) and torch.equal(b, c), i


interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs Triton kernels in the interpreter (TRITON_INTERPRET=1)")


@pytest.mark.triton
@interpreted
def test_deterministic_mode_runs_the_first_configuration_kept(deterministic):
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from fusedlm.backends.triton import _kernels_module

    @triton.jit
    def block_of(OUT, n, BLOCK: tl.constexpr):
        tl.store(OUT, BLOCK)

    def wide_enough(configs, named_args, **kwargs):
        return [c for c in configs if c.kwargs["BLOCK"] >= named_args["n"]]

    configs = [triton.Config({"BLOCK": b}) for b in (16, 64, 32)]
    kernel = _kernels_module("_common").Autotuned(
        block_of, configs, ["n"], {"prune_configs_by": {"early_config_prune": wide_enough}})
    out = torch.zeros(1, dtype=torch.int32)
    for n, block in ((8, 16), (20, 64), (40, 64), (20, 64)):
        kernel[(1,)](out, n)  # never timed: timing needs a GPU, and would pick by speed
        assert out.item() == block, n


@pytest.mark.triton
@interpreted
def test_triton_kernels_run_in_deterministic_mode(deterministic):
    # The interpreter has one configuration: deterministic mode launches it as timing would
    # (attention's pruning and heuristics included), with the same results.
    def run():
        g = torch.Generator().manual_seed(1)
        q, k, v = (_randn(g, 2, 2, 40, 16) for _ in range(3))
        padding = torch.arange(40) >= torch.tensor([[40], [23]])
        results = _with_gradients(g, F.attention(q, k, v, key_padding_mask=padding,
                                                 backend="triton"), [q, k, v])
        inputs = [_randn(g, 30, 64), _randn(g, 30, 64), _randn(g, 64), _randn(g, 64)]
        return results + _with_gradients(g, F.add_layer_norm(*inputs, backend="triton"), inputs)

    fixed = run()
    torch.use_deterministic_algorithms(False)
    for i, (a, b) in enumerate(zip(fixed, run())):
        assert torch.equal(a, b), i
