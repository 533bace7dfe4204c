// A minimal self-registering test harness for the emulator's C++ tests. Every
// tests/emulator/*.cpp may define tests:
//
//   EMU_TEST(ldmatrix_plain) {
//     EMU_CHECK(x == 3, "x is ", x, ", want 3");
//     EMU_CHECK_THROWS(f(), "misaligned");   // throws std::exception whose what() has the text
//   }
//
// main.cpp runs them: `emulator_tests --list` prints the names, `emulator_tests NAME` runs
// one. A failed check records file:line and its message and the test goes on; an exception
// escaping a test fails it too. Names must be unique across all files.
#pragma once
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace emu_test {

struct Test {
  const char* name;
  void (*run)();
  const char* file;
  int line;
};

inline std::vector<Test>& registry() {
  static std::vector<Test> tests;
  return tests;
}

struct Registrar {
  Registrar(const char* name, void (*run)(), const char* file, int line) {
    registry().push_back({name, run, file, line});
  }
};

// Failures of the test running now.
struct Failures {
  int count = 0;
  int printed = 0;
  static constexpr int kPrintLimit = 25;  // the rest are only counted
};

inline Failures& failures() {
  static Failures f;
  return f;
}

inline void record_failure(const char* file, int line, const std::string& message) {
  Failures& f = failures();
  ++f.count;
  if (f.printed < Failures::kPrintLimit) {
    ++f.printed;
    std::fprintf(stdout, "%s:%d: FAILED: %s\n", file, line, message.c_str());
    std::fflush(stdout);
  } else if (f.printed == Failures::kPrintLimit) {
    ++f.printed;
    std::fprintf(stdout, "... (further failures are counted, not printed)\n");
  }
}

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  out.precision(9);
  (void)(out << ... << std::forward<Args>(args));
  return out.str();
}

// Runs f, which must throw a std::exception whose what() contains `needle` (any text when
// needle is empty). Returns "" when it did, else what went wrong.
template <typename F>
std::string expect_throw(F&& f, const std::string& needle) {
  try {
    f();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find(needle) == std::string::npos) {
      return "threw \"" + what + "\", which does not contain \"" + needle + "\"";
    }
    return "";
  } catch (...) {
    return "threw something that is not a std::exception";
  }
  return "did not throw";
}

}  // namespace emu_test

#define EMU_TEST_CONCAT_INNER(a, b) a##b
#define EMU_TEST_CONCAT(a, b) EMU_TEST_CONCAT_INNER(a, b)

// Defines and registers a test; `name` must be an identifier, unique in the binary.
#define EMU_TEST(name)                                                           \
  static void EMU_TEST_CONCAT(emu_test_fn_, name)();                             \
  static const ::emu_test::Registrar EMU_TEST_CONCAT(emu_test_registrar_, name)( \
      #name, &EMU_TEST_CONCAT(emu_test_fn_, name), __FILE__, __LINE__);          \
  static void EMU_TEST_CONCAT(emu_test_fn_, name)()

// EMU_CHECK(cond, message...): records a failure (and goes on) unless cond holds; the
// message, optional, is the concatenation of the remaining arguments, streamed with <<.
#define EMU_CHECK(...) EMU_CHECK_IMPL_(__VA_ARGS__, "")
#define EMU_CHECK_IMPL_(cond, ...)                                                               \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      ::emu_test::record_failure(__FILE__, __LINE__,                                             \
                                 std::string("(" #cond ") ") + ::emu_test::concat(__VA_ARGS__)); \
    }                                                                                            \
  } while (0)

// Records a failure unless the statement throws a std::exception whose what() contains
// `needle` (a string; "" accepts any message).
#define EMU_CHECK_THROWS(statement, needle)                                        \
  do {                                                                             \
    const std::string emu_test_problem_ =                                          \
        ::emu_test::expect_throw([&]() { (void)(statement); }, needle);            \
    if (!emu_test_problem_.empty()) {                                              \
      ::emu_test::record_failure(__FILE__, __LINE__,                               \
                                 std::string(#statement " ") + emu_test_problem_); \
    }                                                                              \
  } while (0)
