#pragma once

// Fetching an image_url that is not a data: URL (`troupe serve
// --allow-remote-images`; off by default). Only http and https; every
// address the host name resolves to must be a public one (no loopback,
// private, link-local, shared, multicast or unspecified address, so a
// request cannot make the gateway reach the machine's own services or the
// cloud metadata address), and the connection goes to the address that was
// checked. Redirects are not followed; the body is capped and timed out.

#include <cstdint>
#include <expected>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::serve {

struct fetch_options {
  bool allow_private = false;  ///< for a trusted intranet (and the tests): skip the address check
  std::size_t max_bytes = 32u << 20;  ///< larger bodies are refused
  int timeout_s = 10;                 ///< connect, read and whole-transfer limit
};

/// Why `ip` (a numeric IPv4 or IPv6 address) is not a public address, e.g.
/// "loopback (127.0.0.0/8)"; empty when it is public. Not an address: says so.
std::string non_public_reason(std::string_view ip);

/// The parts of an http(s) URL; an error for anything else (other schemes,
/// user names in the URL, no host, a bad port).
struct url_parts {
  std::string scheme, host, path;
  int port = 0;
};
std::expected<url_parts, std::string> parse_http_url(std::string_view url);

/// GETs `url` under the rules above; the error says what was refused.
std::expected<std::vector<std::uint8_t>, std::string> fetch_image(std::string_view url,
                                                                  const fetch_options& opt);

}  // namespace troupe::serve
