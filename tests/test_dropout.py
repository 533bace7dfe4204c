"""The dropout stream every backend draws from (fusedlm.ops._dropout): Philox-4x32-10 keyed by
the call's seed and counted by element, on the cpu backend exactly the published generator,
on the cuda backend the same bits, with the keep rate and independence a dropout needs."""
import pytest
import torch

from fusedlm.ops._dropout import cpu_keep_mask
from helpers import backends_for


def philox_4x32_10(counter: int, key: int) -> list:
    """Philox-4x32-10 (Salmon et al. 2011) of a 128-bit counter and a 64-bit key: 4 words."""
    low = 0xFFFFFFFF
    c = [counter >> shift & low for shift in (0, 32, 64, 96)]
    k0, k1 = key & low, key >> 32 & low
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & low, (p0 >> 32) ^ c[3] ^ k1, p0 & low]
        k0, k1 = (k0 + 0x9E3779B9) & low, (k1 + 0xBB67AE85) & low
    return c


def test_philox_reference_gives_the_published_answers():
    # Random123's known-answer vectors for philox4x32, 10 rounds.
    assert philox_4x32_10(0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox_4x32_10(2**128 - 1, 2**64 - 1) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert philox_4x32_10(0x03707344_13198A2E_85A308D3_243F6A88, 0x299F31D0_A4093822) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("offset, length", [(0, 1), (3, 2), (5, 127), (126, 133), (2**34 - 9, 300),
                                            (2**33 + 1, 2051)])
def test_cpu_dropout_stream_is_philox_4x32_10(offset, length):
    # Element e keeps when the top 24 bits of word e % 4 of philox(counter e // 4, key seed),
    # as a fraction of 2^24, are at least p: checked at offsets and lengths that cut the
    # kernel's blocks of counters anywhere, and where a counter's high word carries.
    seed = torch.randint(0, 2**62, ()).item()
    for p in (0.1, 0.5, 0.9):
        threshold = int(p * 2**24)
        expected = [philox_4x32_10(e // 4, seed)[e % 4] >> 8 >= threshold
                    for e in range(offset, offset + length)]
        actual = cpu_keep_mask(torch.tensor(seed), (length,), p, offset=offset)
        assert actual.tolist() == expected


@pytest.mark.parametrize("backend", [p for p in backends_for("add_layer_norm", shapes="real")
                                     if p.id == "cuda"])
def test_cuda_dropout_stream_is_the_cpu_stream(backend):
    # Both draw Philox-4x32-10 keyed by element index: the masks agree bit for bit, at an
    # offset and a length that are not multiples of the 4 elements a Philox call decides.
    import fusedlm._C as C
    seed = torch.tensor(123456789012345)
    for p in (0.1, 0.5):
        gpu = C.cuda.dropout_mask(seed, 7, [1001, 37], p, torch.cuda.current_device())
        assert torch.equal(gpu.cpu(), cpu_keep_mask(seed, (1001, 37), p, offset=7))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_stream_statistics(p):
    # Keep rate within 5 standard deviations of 1 - p, and no visible correlation between neighbours.
    n = 200_000
    keep = cpu_keep_mask(torch.tensor(987654321), (n,), p, offset=12345).double()
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sd
    assert abs(torch.corrcoef(torch.stack([keep[:-1], keep[1:]]))[0, 1].item()) < 0.02
    # Offsets index one stream: a shifted window reproduces the same decisions.
    shifted = cpu_keep_mask(torch.tensor(987654321), (n - 7,), p, offset=12352).double()
    assert torch.equal(shifted, keep[7:])
