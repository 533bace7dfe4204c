"""Builds fusedlm and its compiled extension fusedlm._C.

    pip install --no-build-isolation .        # or -e . for development

Sources come from sources.txt (shared with CMakeLists.txt). The CPU kernels
(group "isa") are compiled once per instruction set into static libraries and
picked at run time; host code and bindings are compiled once with ninja.

Environment:
    FUSEDLM_CUDA=auto|0|1|emulate
                            build the CUDA kernels (auto: when torch has CUDA and nvcc is found);
                            emulate: compile them as C++ against the CUDA emulator
                            (csrc/emulator), so that the cuda backend runs, and is checked,
                            on CPU tensors: a test build, slow by design
    TORCH_CUDA_ARCH_LIST    CUDA targets, default "8.0+PTX;9.0a"
    MAX_JOBS                parallel compile jobs (ninja)
"""
import glob
import os
from concurrent.futures import ThreadPoolExecutor
import platform
import re
import sysconfig
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_clib import build_clib

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as e:  # pragma: no cover - message for users
    raise SystemExit(
        "fusedlm compiles against your installed PyTorch: install torch first, then "
        "`pip install --no-build-isolation .`"
    ) from e

ROOT = Path(__file__).parent.resolve()
# The version, stated once, in the package (python/fusedlm/_version.py).
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "python/fusedlm/_version.py").read_text())[1]
DEFAULT_CUDA_ARCHES = "8.0+PTX;9.0a"
# at::parallel_for's OpenMP backend is a template in ATen's headers, compiled into the host
# code: without -fopenmp its `omp parallel` is ignored and every task runs on the calling
# thread. (Apple's clang has no -fopenmp; there the host code stays single-threaded.)
OPENMP_FLAGS = ["-fopenmp"] if torch._C.has_openmp and platform.system() != "Darwin" else []
# No debug information: Python's compile flags ask for it (-g), and with torch's headers it
# makes up a third of the compile time and most of the extension's size.
NO_DEBUG_INFO = ["-g0"]
# Host code takes the C++ standard torch's headers need; the kernels need C++17.
HOST_FLAGS = ["-O3", "-fvisibility=hidden", *OPENMP_FLAGS, *NO_DEBUG_INFO]
# -fno-trapping-math: the kernels never enable floating-point exceptions, and without it
# GCC will not turn a float ?: into a blend, so loops with one (clamps, selects) stay scalar.
KERNEL_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-fno-trapping-math",
                *NO_DEBUG_INFO]
# Flags of each CPU kernel build. Never -march=native: the wheel must run on any x86-64.
ISA_FLAGS = {
    "baseline": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}


def read_sources():
    """{group: [paths relative to ROOT]} from sources.txt."""
    groups = {}
    for line in (ROOT / "sources.txt").read_text().splitlines():
        line = line.split("#", 1)[0].split()
        if line:
            group, pattern = line
            groups.setdefault(group, []).extend(sorted(glob.glob(pattern, root_dir=ROOT)))
    return groups


def cuda_setting():
    setting = os.environ.get("FUSEDLM_CUDA", "auto").lower()
    if setting not in ("auto", "0", "1", "emulate"):
        raise SystemExit(f"FUSEDLM_CUDA must be auto, 0, 1 or emulate, got {setting!r}")
    return setting


def want_cuda():
    setting = cuda_setting()
    if setting in ("0", "emulate"):
        return False
    has_toolchain = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if setting == "1" and not has_toolchain:
        missing = "this PyTorch has no CUDA" if torch.version.cuda is None else "nvcc was not found (set CUDA_HOME)"
        raise SystemExit(f"FUSEDLM_CUDA=1 asks for the CUDA kernels, but {missing}.")
    return has_toolchain


def isa_libraries(sources):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        names = ["baseline"]
    else:
        names = list(ISA_FLAGS)
    return [
        (
            f"fusedlm_cpu_{isa}",
            {
                "sources": sources,
                "macros": [("FUSEDLM_ISA", isa)],
                "cflags": [*KERNEL_FLAGS, *ISA_FLAGS[isa]],
                "depends": sorted(glob.glob("csrc/cpu/*.h", root_dir=ROOT)),
            },
        )
        for isa in names
    ]


def write_build_info(with_cuda, emulated):
    arches = os.environ["TORCH_CUDA_ARCH_LIST"] if with_cuda else "sm_80;sm_90a" if emulated else ""
    (ROOT / "python/fusedlm/_build_info.py").write_text(
        '"""Written by setup.py: what the extension was compiled against."""\n'
        f"torch_version = {torch.__version__!r}\n"
        f"cuda_version = {torch.version.cuda if with_cuda else None!r}\n"
        f"cuda_arches = {arches!r}\n"
        f"cuda_emulated = {emulated!r}\n"
    )


def sm90a_flags():
    """FUSEDLM_SM90A when the CUDA targets include sm_90a and no plain sm_90 (whose build of
    the Hopper-only kernels is an empty stub): the host code may then launch those kernels
    on an sm_90 device."""
    arches = os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ").split()
    sm90a = any(a.startswith("9.0a") for a in arches)
    sm90 = any(a == "9.0" or a.startswith("9.0+") for a in arches)
    return ["-DFUSEDLM_SM90A"] if sm90a and not sm90 else []


# The CUDA sources see csrc/ (host code, the emulator) and kernels/cuda/ (device code).
CUDA_INCLUDE_DIRS = [str(ROOT / "csrc"), str(ROOT / "kernels/cuda")]
# What the emulation build defines everywhere: the cuda backend is compiled (emulated), with
# its sm_90a paths, which run when the emulator acts as sm_90a.
EMULATE_MACROS = [("FUSEDLM_WITH_CUDA", None), ("FUSEDLM_EMULATE", None), ("FUSEDLM_SM90A", None)]


def emulated_cuda_libraries(sources):
    """The emulation build's static libraries, in link order: the cuda backend compiled as C++
    with ThreadSanitizer's instrumentation (whose hooks the emulator implements, to check
    every load and store of the kernels), then the emulator itself, uninstrumented."""
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    torch_flags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-std=c++20", "-fPIC", "-O2",
                   "-fvisibility=hidden", *NO_DEBUG_INFO]
    # Python's headers too: entry points bind themselves (csrc/bind.h).
    include_dirs = [*CUDA_INCLUDE_DIRS, *cpp_extension.include_paths(),
                    sysconfig.get_paths()["include"]]
    return [
        ("fusedlm_cuda_emulated", {
            "sources": sources["cuda"],
            "macros": EMULATE_MACROS,
            "cflags": [*torch_flags, "-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"],
            "preargs": ["-x", "c++"],
            "include_dirs": include_dirs,
            "depends": sorted(glob.glob("kernels/cuda/*.cuh", root_dir=ROOT))
            + sorted(glob.glob("csrc/**/*.h", root_dir=ROOT, recursive=True)),
        }),
        ("fusedlm_emulator", {
            "sources": sorted(glob.glob("csrc/emulator/*.cpp", root_dir=ROOT)),
            "macros": [],
            "cflags": ["-std=c++17", "-fPIC", "-O2", "-fvisibility=hidden", *NO_DEBUG_INFO],
            "include_dirs": [str(ROOT / "csrc")],
            "depends": sorted(glob.glob("csrc/emulator/*.h", root_dir=ROOT)),
        }),
    ]


# Nothing outside the emulated cuda backend refers to it (its entry points bind themselves,
# csrc/bind.h), so the linker takes its whole library, then the emulator that serves it.
EMULATED_LINK_FLAGS = ["-Wl,--whole-archive", "-lfusedlm_cuda_emulated", "-Wl,--no-whole-archive",
                       "-lfusedlm_emulator", "-ldl"]


def extension(sources, with_cuda, emulated):
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo", *(sm90a_flags() if with_cuda else [])]
    macros = [("FUSEDLM_WITH_CUDA", None)] if with_cuda else EMULATE_MACROS if emulated else []
    kwargs = dict(
        name="fusedlm._C",
        sources=sources["host"] + (sources.get("cuda", []) if with_cuda else []),
        include_dirs=CUDA_INCLUDE_DIRS,
        extra_compile_args={"cxx": HOST_FLAGS, "nvcc": nvcc_flags},
        define_macros=macros,
        extra_link_args=OPENMP_FLAGS + (EMULATED_LINK_FLAGS if emulated else []),
    )
    if with_cuda:
        return cpp_extension.CUDAExtension(**kwargs)
    kwargs["extra_compile_args"] = kwargs["extra_compile_args"]["cxx"]
    return cpp_extension.CppExtension(**kwargs)


class BuildIsaLibraries(build_clib):
    """Compiles each instruction set's kernel library into its own object folder (the same
    sources are compiled once per instruction set), MAX_JOBS sources at a time across all
    the libraries, as ninja compiles the extension (setuptools compiles one at a time)."""

    def build_libraries(self, libraries):
        if ".cu" not in self.compiler.src_extensions:  # the emulation build's CUDA sources
            self.compiler.src_extensions.append(".cu")

        def compile_one(name, info, source):
            return self.compiler.compile(
                [source],
                output_dir=os.path.join(self.build_temp, name),
                macros=info["macros"],
                include_dirs=info.get("include_dirs"),
                extra_preargs=info.get("preargs"),
                extra_postargs=info["cflags"],
                depends=info["depends"],
            )

        jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            compiled = {name: [pool.submit(compile_one, name, info, source)
                               for source in info["sources"]] for name, info in libraries}
            for name, objects in compiled.items():
                objects = [obj for job in objects for obj in job.result()]
                self.compiler.create_static_lib(objects, name, output_dir=self.build_clib)


class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """Builds the per-instruction-set kernel libraries first (editable installs run
    build_ext alone, without the build_clib step of a full build)."""

    def run(self):
        self.run_command("build_clib")
        super().run()


sources = read_sources()
with_cuda = want_cuda()
emulated = cuda_setting() == "emulate"
if with_cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHES)
write_build_info(with_cuda, emulated)

TRANSFORMERS = "transformers>=5.17,<6"

setup(
    name="fusedlm",
    version=VERSION,
    description="Fused CUDA, Triton and CPU kernels for BERT, GPT, ELECTRA and ELMo in PyTorch",
    python_requires=">=3.10",
    package_dir={"": "python", "fusedlm.triton_kernels": "kernels/triton"},
    packages=find_packages("python") + ["fusedlm.triton_kernels"],
    libraries=isa_libraries(sources["isa"]) + (emulated_cuda_libraries(sources) if emulated else []),
    ext_modules=[extension(sources, with_cuda, emulated)],
    cmdclass={"build_clib": BuildIsaLibraries, "build_ext": BuildExtension},
    install_requires=["torch>=2.11", "numpy"],
    entry_points={"console_scripts": ["fusedlm = fusedlm.cli:main"]},
    extras_require={
        "triton": ["triton>=3.6"],
        # fusedlm.models and the command line are transformers models: the releases tested
        "hf": [TRANSFORMERS, "tokenizers", "safetensors"],
        "cli": [TRANSFORMERS, "tokenizers", "safetensors", "tqdm", "matplotlib"],
        "elmo": ["h5py"],
        # fusedlm bench's ONNX Runtime baseline of BERT inference
        "bench": ["onnx", "onnxruntime"],
        "test": ["pytest", "hypothesis"],
    },
    zip_safe=False,
)
