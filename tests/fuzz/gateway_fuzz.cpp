// libFuzzer target: the OpenAI gateway's request parsing (serve/openai.cpp):
// chat and completion bodies and transcription uploads (multipart/form-data)
// under the default limits and under tight ones (depth, values, images,
// clips, text), and the data: URL decoder. Whatever the
// body, a parse either fails with a 4xx or yields a job within the limits.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "serve/openai.hpp"

namespace {

void check(const std::expected<troupe::serve::api_request, troupe::serve::api_error>& r,
           const troupe::serve::request_limits& l) {
  if (!r) {
    if (r.error().status < 400 || r.error().status > 499) __builtin_trap();
    return;
  }
  const auto& j = r->job;
  if (j.images.size() > l.max_images || j.turns.size() > l.max_messages ||
      j.stop_strings.size() > l.max_stops || j.max_tokens > l.max_tokens)
    __builtin_trap();
  for (const auto& im : j.images)
    if (im.bytes.size() > l.max_image_bytes) __builtin_trap();
  if (j.audios.size() > l.max_audios) __builtin_trap();
  for (const auto& a : j.audios)
    if (a.bytes.size() > l.max_audio_bytes) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::serve;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  request_limits wide{};
  request_limits tight;
  tight.max_messages = 4;
  tight.max_images = 2;
  tight.max_image_bytes = 256;
  tight.max_text_bytes = 512;
  tight.max_tokens = 64;
  tight.max_stops = 2;
  tight.max_audios = 1;
  tight.max_audio_bytes = 256;
  tight.max_json_depth = 6;
  tight.max_json_values = 64;
  tight.remote_images = true;
  for (const auto* l : {&wide, &tight}) {
    check(parse_chat_request(body, *l), *l);
    check(parse_completion_request(body, *l), *l);
    // The same bytes as a transcription upload (multipart/form-data).
    check(parse_transcription_request("multipart/form-data; boundary=b", body, *l), *l);
  }
  if (auto parts = parse_form_data("multipart/form-data; boundary=\"b\"", body, 4);
      parts && parts->size() > 4)
    __builtin_trap();
  if (auto b = decode_data_url(body, 1024); b && b->size() > 1024) __builtin_trap();
  return 0;
}
