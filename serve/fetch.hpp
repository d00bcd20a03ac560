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

/// Why a fetch failed: the code decides what the gateway answers (an HTTP
/// status), the message says to the client what was refused.
enum class fetch_errc : std::uint8_t {
  bad_url,            ///< not an http(s) URL that is fetched (scheme, user name, host, port, path)
  not_found,          ///< the host name does not resolve
  forbidden_address,  ///< the host name resolves to an address that is not public
  redirect,           ///< the server answers with a redirect (not followed)
  bad_status,         ///< the server answers with a status other than 200
  too_large,          ///< the body is over fetch_options::max_bytes
  timeout,            ///< the transfer took longer than fetch_options::timeout_s
  empty,              ///< the body is empty
  io,                 ///< no connection, or the transfer broke off
};

struct fetch_error {
  fetch_errc code = fetch_errc::io;
  std::string message;
};

struct fetch_options {
  bool allow_private = false;  ///< for a trusted intranet (and the tests): skip the address check
  std::size_t max_bytes = 32u << 20;  ///< larger bodies are refused
  int timeout_s = 10;                 ///< connect, read and whole-transfer limit
  std::string accept = "image/*";     ///< the Accept header
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
/// Errors have the code bad_url.
std::expected<url_parts, fetch_error> parse_http_url(std::string_view url);

/// GETs `url` under the rules above; the error says what was refused.
std::expected<std::vector<std::uint8_t>, fetch_error> fetch_image(std::string_view url,
                                                                  const fetch_options& opt);

}  // namespace troupe::serve
