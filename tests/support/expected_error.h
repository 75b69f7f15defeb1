// The message of an Error a test expects, for tests that check an error names the right thing.
#pragma once

#include <string>

#include "catch.h"
#include "core/base/error.h"

namespace moetrain::testing {

// Runs `body`, which must throw an Error with exit code `code`; returns its message (a body that
// throws none fails the test).
template <class Body>
std::string expected_error(ExitCode code, Body&& body) {
  try {
    body();
  } catch (const Error& e) {
    CHECK(e.code() == code);
    return e.what();
  }
  FAIL("expected moetrain::Error (" << exit_code_name(code) << "), nothing was thrown");
  return "";
}

}  // namespace moetrain::testing
