"""The CUDA emulator's C++ tests (tests/emulator/*.cpp), one pytest case per C++ test.

The test binary is built from every tests/emulator/*.cpp and csrc/emulator/*.cpp with the
system C++ compiler into build/emulator-tests/; a later run recompiles only the objects whose
source or included headers are newer than the object (or whose command changed) and relinks
only then. `emulator_tests --list` names the tests and `emulator_tests NAME` runs one (exit
status 0 when it passes). Without a C++ compiler the module is skipped.
"""
import concurrent.futures
import fcntl
import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS_DIR = ROOT / "tests" / "emulator"  # instrumented sources: the tests (and, through them, kernels)
EMULATOR_DIR = ROOT / "csrc" / "emulator"  # the emulator itself, never instrumented
BUILD_DIR = ROOT / "build" / "emulator-tests"
BINARY = BUILD_DIR / "emulator_tests"

# Flags of every compile.
COMMON_FLAGS = ["-std=c++17", "-O1", "-g", "-pthread", f"-I{ROOT / 'csrc'}", f"-I{TESTS_DIR}"]
# Extra flags of the instrumented sources (tests/emulator/*.cpp, as the kernels are in the
# emulation build): ThreadSanitizer's instrumentation, whose hooks (__tsan_read4, ...) the
# emulator's runtime implements. The link has no -fsanitize: no TSan runtime library.
INSTRUMENTED_FLAGS = ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]
LINK_FLAGS = ["-pthread", "-ldl"]

COMPILE_TIMEOUT_S = 900
RUN_TIMEOUT_S = 900

# Parameters that stand for "no test to run" (not C++ identifiers, so no test has their name).
NO_COMPILER = "no-compiler"
BUILD_FAILED = "build-failed"


def find_compiler():
    """The C++ compiler: $CXX if set, else c++, g++ or clang++ on PATH; None if none."""
    candidates = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    for name in candidates:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


COMPILER = find_compiler()

pytestmark = [
    pytest.mark.emulator,
    pytest.mark.skipif(COMPILER is None,
                       reason="no C++ compiler found ($CXX, c++, g++ or clang++) to build tests/emulator"),
]


def sources():
    """(source, instrumented) for every file of the binary, in a stable order."""
    return ([(path, True) for path in sorted(TESTS_DIR.glob("*.cpp"))] +
            [(path, False) for path in sorted(EMULATOR_DIR.glob("*.cpp"))])


def object_path(source):
    return BUILD_DIR / f"{source.parent.parent.name}_{source.parent.name}_{source.stem}.o"


def compile_command(compiler, source, instrumented):
    """The command that compiles one source into its object file."""
    flags = COMMON_FLAGS + (INSTRUMENTED_FLAGS if instrumented else [])
    return [compiler, *flags, "-c", str(source), "-o", str(object_path(source))]


def link_command(compiler, objects, output):
    """The command that links the objects into the test binary."""
    return [compiler, *map(str, objects), *LINK_FLAGS, "-o", str(output)]


def _dependencies(obj):
    """The files an object was built from, per the compiler's -MMD output; None if unknown."""
    depfile = obj.with_suffix(".d")
    if not depfile.exists():
        return None
    text = depfile.read_text().replace("\\\n", " ")
    _, _, rest = text.partition(":")
    return [Path(token) for token in rest.split()]


def _stale(target, command, dependencies):
    """Whether target must be rebuilt: missing, built by another command, or older than one of
    its dependencies (None: unknown, so stale)."""
    stamp = target.with_name(target.name + ".cmd")
    if not target.exists() or not stamp.exists() or stamp.read_text() != " ".join(command):
        return True
    if dependencies is None:
        return True
    built = target.stat().st_mtime
    return any(not path.exists() or path.stat().st_mtime > built for path in dependencies)


def _run(command):
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def build():
    """Builds the test binary: compiles the objects whose source or headers changed (or whose
    command did) and links when any object changed. Returns None on success, else the error."""
    srcs = sources()
    if not srcs:
        return f"no sources in {TESTS_DIR} or {EMULATOR_DIR}"
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    objects = [object_path(source) for source, _ in srcs]
    compiles = [compile_command(COMPILER, source, instrumented) for source, instrumented in srcs]
    link = link_command(COMPILER, objects, BINARY)
    with open(BUILD_DIR / "build.lock", "w") as lock:  # one build at a time (pytest-xdist workers)
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = [(command, obj) for command, obj in zip(compiles, objects)
                if _stale(obj, command, _dependencies(obj))]
        if todo:
            # -MMD -MF: the headers each object includes, for the next staleness check.
            commands = [command + ["-MMD", "-MF", str(obj.with_suffix(".d"))] for command, obj in todo]
            workers = max(1, min(len(commands), os.cpu_count() or 1))
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                results = list(pool.map(_run, commands))
            errors = []
            for (command, obj), full, result in zip(todo, commands, results):
                if result.returncode:
                    obj.unlink(missing_ok=True)
                    errors.append(f"$ {' '.join(full)}\n{result.stdout}{result.stderr}")
                else:
                    obj.with_name(obj.name + ".cmd").write_text(" ".join(command))
            if errors:
                return "\n\n".join(errors)
        if todo or _stale(BINARY, link, objects):
            temporary = BINARY.with_name(f"{BINARY.name}.tmp{os.getpid()}")
            result = _run(link_command(COMPILER, objects, temporary))
            if result.returncode:
                return f"$ {' '.join(link)}\n{result.stdout}{result.stderr}"
            os.replace(temporary, BINARY)
            BINARY.with_name(BINARY.name + ".cmd").write_text(" ".join(link))
    return None


@functools.lru_cache(maxsize=None)
def emulator_test_names():
    """The C++ tests' names, or a one-element list of NO_COMPILER / BUILD_FAILED."""
    if COMPILER is None:
        return [NO_COMPILER]
    if build() is not None:
        return [BUILD_FAILED]
    listing = subprocess.run([str(BINARY), "--list"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listing.returncode != 0:
        return [BUILD_FAILED]
    return [line.strip() for line in listing.stdout.splitlines() if line.strip()]


def pytest_generate_tests(metafunc):
    if "emulator_test" in metafunc.fixturenames:
        names = emulator_test_names()
        metafunc.parametrize("emulator_test", names, ids=names)


def test_emulator(emulator_test):
    if emulator_test == NO_COMPILER:
        pytest.skip("no C++ compiler")
    if emulator_test == BUILD_FAILED:
        error = build()
        if error is None:
            listing = subprocess.run([str(BINARY), "--list"], cwd=ROOT, capture_output=True, text=True,
                                     timeout=60)
            error = f"{BINARY} --list exited {listing.returncode}\n{listing.stdout}{listing.stderr}"
        pytest.fail(f"building the emulator tests failed:\n{error}", pytrace=False)
    result = subprocess.run([str(BINARY), emulator_test], cwd=ROOT, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    if result.returncode != 0:
        pytest.fail(f"{BINARY.name} {emulator_test} exited {result.returncode}:\n"
                    f"{result.stdout}{result.stderr}", pytrace=False)
