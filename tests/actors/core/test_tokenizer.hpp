// The bundled tiny LLaVA's tokenizer, loaded once per test process (the
// scheduler's tests need one to turn tokens into text).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "models/tokenizer.hpp"

namespace troupe::test {

inline std::shared_ptr<const models::tokenizer> bundled_tokenizer() {
  static auto tok = [] {
    auto t = models::tokenizer::load(std::string(TROUPE_FIXTURES_DIR) +
                                     "/../../assets/tiny-llava-shapes/tokenizer.json");
    EXPECT_TRUE(t) << (t ? "" : t.error().message);
    return t ? std::make_shared<const models::tokenizer>(std::move(*t)) : nullptr;
  }();
  return tok;
}

}  // namespace troupe::test
