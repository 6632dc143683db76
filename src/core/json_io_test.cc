#include "core/json_io.h"

#include <doctest/doctest.h>

namespace fsdp {
namespace {

TEST_CASE("malformed JSON reports file, line and column") {
  auto r = ParseJson("{\n  \"a\": 1,\n  \"b\": ,\n}", "x.json");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message.starts_with("x.json:3:8: malformed JSON:"));
  CHECK(r.error().message.find('\n') == std::string::npos);
}

TEST_CASE("missing files are reported with their path") {
  auto r = LoadJsonFile("/nonexistent/file.json");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message == "/nonexistent/file.json: cannot open file");
}

TEST_CASE("typed readers accept integral floats and reject wrong types") {
  auto json = ParseJson(R"({"i": 4.0, "f": 1.5, "s": "x", "b": true, "neg": -1, "o": {"k": 2}})", "t").value();
  JsonReader r(json, "t");
  CHECK(r.Int("i").value() == 4);
  CHECK_FALSE(r.Int("f").ok());
  CHECK(r.Int("f").error().message == "t: key 'f': expected an integer, got number 1.5");
  CHECK_FALSE(r.Int("absent").ok());
  CHECK_FALSE(r.OptionalInt("absent").value().has_value());
  CHECK_FALSE(r.PositiveNumber("neg").ok());
  CHECK(r.NonNegativeNumber("i").value() == 4.0);
  CHECK(r.String("s").value() == "x");
  CHECK_FALSE(r.String("b").ok());
  CHECK(r.Object("o").value().Int("k").value() == 2);
  CHECK(r.Object("o").value().Int("missing").error().message == "t: o: key 'missing': missing");
  CHECK_FALSE(r.Object("s").ok());
}

}  // namespace
}  // namespace fsdp
