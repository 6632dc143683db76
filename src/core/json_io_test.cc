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

TEST_CASE("numbers no double holds are a one-line error, not an exception") {
  auto r = ParseJson(R"({"model_type": "llama", "bos_token_id": 1e400})", "c.json");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message == "c.json: malformed JSON: number overflow parsing '1e400' (a JSON number must fit a double, |x| < 1.8e308)");
}

TEST_CASE("nesting past kMaxJsonDepth is refused before parsing, brackets in strings do not count") {
  const std::string deep = std::string(60000, '[') + std::string(60000, ']');
  auto r = ParseJson(deep, "d.json");
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message == "d.json:1:129: JSON nested deeper than 128 levels");
  const std::string at_limit = std::string(128, '[') + std::string(128, ']');
  CHECK(ParseJson(at_limit, "ok").ok());
  CHECK(ParseJson(R"({"s": ")" + std::string(1000, '[') + "\"}", "ok").ok());
  CHECK(ParseJson(R"({"s": "\\", "t": [[1]]})", "ok").ok());  // an escaped backslash ends before the quote
}

TEST_CASE("error messages describe values in bounded length") {
  auto json = ParseJson(R"({"a": [[1, 2], [3]], "o": {"k": 1, "l": 2}, "s": ")" + std::string(100000, 'x') + "\"}", "t").value();
  JsonReader r(json, "t");
  CHECK(r.Int("a").error().message == "t: key 'a': expected an integer, got array of 2 elements");
  CHECK(r.Int("o").error().message == "t: key 'o': expected an integer, got object of 2 keys");
  const std::string s = r.Int("s").error().message;
  CHECK(s == "t: key 's': expected an integer, got string \"" + std::string(40, 'x') + "...\" (100000 bytes)");
}

TEST_CASE("integers past INT64_MAX are out of range, not wrapped to negative") {
  auto json = ParseJson(R"({"h": 18446744073709551615, "m": 9223372036854775807})", "t").value();
  JsonReader r(json, "t");
  CHECK(r.Int("h").error().message == "t: key 'h': 18446744073709551615 is out of range for a 64-bit integer");
  CHECK(r.Int("m").value() == INT64_MAX);
}

TEST_CASE("DumpJson replaces invalid UTF-8 instead of throwing") {
  Json j = {{"path", std::string("/tmp/\xff.json")}};
  CHECK(DumpJson(j) == "{\"path\":\"/tmp/\xef\xbf\xbd.json\"}");
}

}  // namespace
}  // namespace fsdp
