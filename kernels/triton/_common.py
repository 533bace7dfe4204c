"""Pieces the Triton kernels share: autotuning, dropout's keep mask, GELU and its derivative
(written not to cancel for negative inputs).

Dropout is a counter-based stream like the cpu backend's (not the same bits): element e
of a call is kept when Philox(seed, e) >= p, so a backward regenerates the forward's mask
from the seed alone. ``keep_mask`` materialises it, for tests that replay it.
"""
import torch
import triton
import triton.language as tl

from fusedlm import switches

# Whether the kernels run in Triton's interpreter (read once, as Triton reads it).
_INTERPRETING = switches.value("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    return _INTERPRETING


def autotune(configs, key, **options):
    """triton.autotune over ``configs`` (an :class:`Autotuned` kernel); in the interpreter
    only the first (with one config Triton benchmarks nothing), so CPU tests do not time
    every configuration."""
    return lambda fn: Autotuned(fn, configs[:1] if interpreting() else configs, key, options)


class Autotuned:
    """A kernel autotuned over ``configs``: each key runs the configuration timed fastest at
    its first launch. A configuration sets the blocks a sum is split into, and so the order
    of its additions, and timings pick a different one from run to run (or GPU to GPU of a
    model): while ``torch.are_deterministic_algorithms_enabled()``, the kernel runs the
    first configuration the pruning keeps instead, untimed. Anything else (``fn``,
    ``warmup``, ``configs``) is the autotuned kernel's."""

    def __init__(self, fn, configs, key, options):
        self.tuned = triton.autotune(configs, key=key, **options)(fn)
        self._prune = options.get("prune_configs_by", {}).get("early_config_prune")
        rest = {k: v for k, v in options.items() if k != "prune_configs_by"}
        # One single-configuration kernel per configuration: Triton never times those.
        self._fixed = [(c, triton.autotune([c], key=key, **rest)(fn)) for c in configs]

    def __getitem__(self, grid):
        if not torch.are_deterministic_algorithms_enabled():
            return self.tuned[grid]
        return lambda *args, **kwargs: self.fixed(args, kwargs)[grid](*args, **kwargs)

    def fixed(self, args, kwargs):
        """The single-configuration kernel that deterministic mode runs for these arguments."""
        kept = [c for c, _ in self._fixed]
        if self._prune is not None:
            kept = self._prune(kept, dict(zip(self.tuned.arg_names, args)), **kwargs)
        return next(kernel for c, kernel in self._fixed if c is kept[0])

    def __getattr__(self, name):
        return getattr(self.tuned, name)


def upcast_products(dtype: torch.dtype) -> bool:
    """Triton's interpreter (3.9) multiplies bfloat16 blocks wrongly: there the operands go
    through float32, which holds their products exactly."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """float32 products are exact float32 unless torch allows TF32 for its own."""
    exact = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    if upcast_products(dtype) or exact:
        return "ieee"
    return "tf32"


# --- the row-wise ops (add_layer_norm, rms_norm) -----------------------------------------------
# A forward program holds one row whole in registers; a backward program walks a contiguous
# range of rows, keeping its share of the parameter gradients, which land in a
# [programs, hidden] buffer summed over programs afterwards. The program count depends only
# on the shape and the device, so those gradients repeat bit for bit (no atomics).

def row_configs():
    """What a row kernel is tuned over: its warps."""
    return [triton.Config({}, num_warps=w) for w in (4, 8, 16, 2)]


def row_block(hidden: int) -> int:
    return triton.next_power_of_2(hidden)


def row_programs(rows: int, device: torch.device) -> int:
    """A backward's programs: a few per multiprocessor, fixed per shape and device."""
    slots = 8 if interpreting() else 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return min(rows, slots)


def contiguous(t):
    """t contiguous, or None."""
    return None if t is None else t.contiguous()


@triton.jit
def program_rows(rows, rows_per_program):
    """The rows [first, last) a backward program walks."""
    first = tl.program_id(0).to(tl.int64) * rows_per_program
    return first, tl.minimum(first + rows_per_program, rows)


@triton.jit
def load_row(P, offsets, mask):
    """A row (or a [hidden] parameter) in float32, zeros past its end."""
    return tl.load(P + offsets, mask=mask, other=0.0).to(tl.float32)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous [rows, last dim] matrix."""
    return t.contiguous().view(-1, t.shape[-1])


def seed_of(seed: torch.Tensor, p: float) -> int:
    """The dropout seed as a kernel argument (the ops draw it on the CPU: no device sync)."""
    return int(seed.item()) if p > 0 else 0


@triton.jit
def keep(seed, offsets, p):
    """True where element ``offsets`` of stream ``seed`` survives dropout with rate p."""
    return tl.rand(seed, offsets) >= p


@triton.jit
def tanh(u):
    """tanh to a few ulp: below |u| = 0.625 an odd polynomial (Cephes' tanhf), where
    (1 - e) / (1 + e) would cancel; above, from e = exp(-2|u|) <= 1, which cannot overflow."""
    a = tl.abs(u)
    z = u * u
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
              + 1.33314422036e-1) * z - 3.33332819422e-1) * z * a + a
    e = tl.exp(-2.0 * a)
    t = tl.where(a < 0.625, small, (1.0 - e) / (1.0 + e))
    return tl.where(u < 0, -t, t)


@triton.jit
def normal_cdf(z):
    """Phi(z) = erfc(-z / sqrt(2)) / 2 to ~1e-7 relative on both sides (1 + erf(z / sqrt(2))
    would cancel for negative z). erfc(a), a >= 0, from Numerical Recipes' Chebyshev fit."""
    a = tl.abs(z) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * a)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    half_tail = 0.5 * t * tl.exp(-a * a + poly)
    return tl.where(z < 0, half_tail, 1.0 - half_tail)


@triton.jit
def gelu(z, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        # 0.5 * (1 + tanh(u)) = sigmoid(2u), which does not cancel where tanh(u) nears -1.
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        return z / (1.0 + tl.exp(-2.0 * u))
    else:
        return z * normal_cdf(z)


@triton.jit
def gelu_grad(z, APPROX_TANH: tl.constexpr):
    """d gelu(z) / dz."""
    if APPROX_TANH:
        # With s = sigmoid(2u) and e = exp(-2u): s + z * 2 s (1 - s) du, and s (1 - s) = e s^2.
        # u is clamped where s has saturated, so that e stays finite (inf * 0 would be NaN).
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        e = tl.exp(-2.0 * tl.minimum(tl.maximum(u, -40.0), 40.0))
        s = 1.0 / (1.0 + e)
        du = 0.7978845608028654 * (1.0 + 0.134145 * z * z)
        return s + 2.0 * z * du * ((e * s) * s)  # e * s = 1 - s <= 1: nothing overflows
    else:
        return normal_cdf(z) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)


@triton.jit
def _keep_mask_kernel(OUT, n, seed, p, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + offsets, keep(seed, offsets, p).to(tl.int8), mask=offsets < n)


def keep_mask(seed: torch.Tensor, shape, p: float, device="cpu") -> torch.Tensor:
    """The keep mask (bool, True = keep) the Triton kernels use for stream ``seed``, element
    order row-major over ``shape``."""
    out = torch.empty(shape, dtype=torch.int8, device=device)
    n = out.numel()
    if n:
        _keep_mask_kernel[(triton.cdiv(n, 1024),)](out, n, seed_of(seed, p), p, BLOCK=1024)
    return out.bool()
