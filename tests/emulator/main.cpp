// The emulator tests' driver (harness.h):
//   emulator_tests --list    the test names, one a line (exit 2 if two tests share a name)
//   emulator_tests NAME...   runs those tests; exit 0 when all pass, 1 when one fails,
//                            2 for an unknown name
//   emulator_tests           runs every test
#include <cstdio>
#include <cstring>
#include <exception>
#include <set>
#include <string>

#include "harness.h"

namespace {

bool unique_names() {
  std::set<std::string> seen;
  bool ok = true;
  for (const emu_test::Test& t : emu_test::registry()) {
    if (!seen.insert(t.name).second) {
      std::fprintf(stderr, "duplicate test name %s (%s:%d)\n", t.name, t.file, t.line);
      ok = false;
    }
  }
  return ok;
}

// Runs one test; true when it passed.
bool run(const emu_test::Test& test) {
  emu_test::failures() = emu_test::Failures{};
  std::fprintf(stdout, "[ RUN  ] %s\n", test.name);
  std::fflush(stdout);
  try {
    test.run();
  } catch (const std::exception& e) {
    emu_test::record_failure(test.file, test.line, std::string("uncaught exception: ") + e.what());
  } catch (...) {
    emu_test::record_failure(test.file, test.line,
                             "uncaught exception that is not a std::exception");
  }
  const int count = emu_test::failures().count;
  std::fprintf(stdout, "[ %s ] %s (%d failed check%s)\n", count ? "FAIL" : " OK ", test.name, count,
               count == 1 ? "" : "s");
  std::fflush(stdout);
  return count == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (!unique_names()) return 2;
  const auto& tests = emu_test::registry();
  if (argc == 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const emu_test::Test& t : tests) std::printf("%s\n", t.name);
    return 0;
  }
  bool ok = true;
  if (argc == 1) {
    for (const emu_test::Test& t : tests) ok = run(t) && ok;
    return ok ? 0 : 1;
  }
  for (int i = 1; i < argc; ++i) {
    const emu_test::Test* found = nullptr;
    for (const emu_test::Test& t : tests) {
      if (std::strcmp(t.name, argv[i]) == 0) found = &t;
    }
    if (found == nullptr) {
      std::fprintf(stderr, "no test named %s (--list shows them)\n", argv[i]);
      return 2;
    }
    ok = run(*found) && ok;
  }
  return ok ? 0 : 1;
}
