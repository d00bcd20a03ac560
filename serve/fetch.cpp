#include "serve/fetch.hpp"

#include <arpa/inet.h>
#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>

#include <array>
#include <cctype>
#include <chrono>
#include <cstring>
#include <memory>

namespace troupe::serve {

namespace {

struct v4_range {
  std::uint32_t net;
  int bits;
  const char* what;
};

constexpr std::uint32_t v4(int a, int b, int c, int d) {
  return (static_cast<std::uint32_t>(a) << 24) | (static_cast<std::uint32_t>(b) << 16) |
         (static_cast<std::uint32_t>(c) << 8) | static_cast<std::uint32_t>(d);
}

// IANA special-purpose IPv4 ranges (RFC 6890 and after) a gateway must not
// be steered to.
constexpr std::array<v4_range, 15> v4_blocked{{
    {v4(0, 0, 0, 0), 8, "this network (0.0.0.0/8)"},
    {v4(10, 0, 0, 0), 8, "private (10.0.0.0/8)"},
    {v4(100, 64, 0, 0), 10, "shared address space (100.64.0.0/10)"},
    {v4(127, 0, 0, 0), 8, "loopback (127.0.0.0/8)"},
    {v4(169, 254, 0, 0), 16, "link-local (169.254.0.0/16)"},
    {v4(172, 16, 0, 0), 12, "private (172.16.0.0/12)"},
    {v4(192, 0, 0, 0), 24, "IETF protocol assignments (192.0.0.0/24)"},
    {v4(192, 0, 2, 0), 24, "documentation (192.0.2.0/24)"},
    {v4(192, 168, 0, 0), 16, "private (192.168.0.0/16)"},
    {v4(198, 18, 0, 0), 15, "benchmarking (198.18.0.0/15)"},
    {v4(198, 51, 100, 0), 24, "documentation (198.51.100.0/24)"},
    {v4(203, 0, 113, 0), 24, "documentation (203.0.113.0/24)"},
    {v4(224, 0, 0, 0), 4, "multicast (224.0.0.0/4)"},
    {v4(240, 0, 0, 0), 4, "reserved (240.0.0.0/4)"},
    {v4(255, 255, 255, 255), 32, "broadcast"},
}};

std::string v4_reason(std::uint32_t a) {
  for (const auto& r : v4_blocked) {
    const std::uint32_t mask = r.bits == 0 ? 0 : ~std::uint32_t{0} << (32 - r.bits);
    if ((a & mask) == (r.net & mask)) return r.what;
  }
  return {};
}

std::string v6_reason(const std::uint8_t (&b)[16]) {
  static const std::uint8_t zero[16] = {};
  if (std::memcmp(b, zero, 16) == 0) return "unspecified (::)";
  if (std::memcmp(b, zero, 15) == 0 && b[15] == 1) return "loopback (::1)";
  // IPv4-mapped (::ffff:a.b.c.d) and IPv4-compatible: judge the IPv4 address.
  const bool mapped = std::memcmp(b, zero, 10) == 0 && b[10] == 0xff && b[11] == 0xff;
  const bool nat64 = b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b &&
                     std::memcmp(b + 4, zero, 8) == 0;
  if (mapped || nat64) {
    const auto r = v4_reason(v4(b[12], b[13], b[14], b[15]));
    return r.empty() ? std::string{} : "IPv4 inside IPv6, " + r;
  }
  if ((b[0] & 0xfe) == 0xfc) return "unique local (fc00::/7)";
  if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80) return "link-local (fe80::/10)";
  if (b[0] == 0xfe && (b[1] & 0xc0) == 0xc0) return "site-local (fec0::/10)";
  if (b[0] == 0xff) return "multicast (ff00::/8)";
  if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x0d && b[3] == 0xb8)
    return "documentation (2001:db8::/32)";
  if (b[0] == 0x20 && b[1] == 0x02) return "6to4 (2002::/16)";  // may wrap any IPv4 address
  if ((b[0] & 0xe0) != 0x20) return "not global unicast (outside 2000::/3)";
  return {};
}

std::string reason_of(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    return v4_reason(ntohl(in->sin_addr.s_addr));
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    std::uint8_t b[16];
    std::memcpy(b, in6->sin6_addr.s6_addr, 16);
    return v6_reason(b);
  }
  return "not an IP address";
}

std::string text_of(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof buf);
  else if (sa->sa_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof buf);
  return buf;
}

std::unexpected<fetch_error> fail(fetch_errc code, std::string message) {
  return std::unexpected(fetch_error{code, std::move(message)});
}

std::unexpected<fetch_error> url_error(std::string message) {
  return fail(fetch_errc::bad_url, std::move(message));
}

}  // namespace

std::string non_public_reason(std::string_view ip) {
  const std::string s(ip);
  in_addr a4{};
  if (::inet_pton(AF_INET, s.c_str(), &a4) == 1) return v4_reason(ntohl(a4.s_addr));
  in6_addr a6{};
  if (::inet_pton(AF_INET6, s.c_str(), &a6) == 1) {
    std::uint8_t b[16];
    std::memcpy(b, a6.s6_addr, 16);
    return v6_reason(b);
  }
  return "'" + s.substr(0, 64) + "' is not a numeric IP address";
}

std::expected<url_parts, fetch_error> parse_http_url(std::string_view url) {
  url_parts p;
  const auto sep = url.find("://");
  if (sep == std::string_view::npos) return url_error("not a URL (no scheme)");
  for (char c : url.substr(0, sep))
    p.scheme += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (p.scheme != "http" && p.scheme != "https")
    return url_error("the scheme '" + p.scheme.substr(0, 16) + "' is not fetched (http or https)");
  auto rest = url.substr(sep + 3);
  const auto slash = rest.find_first_of("/?#");
  auto authority = rest.substr(0, slash);
  p.path = slash == std::string_view::npos ? "/" : std::string(rest.substr(slash));
  if (p.path[0] != '/') p.path = "/" + p.path;
  if (const auto hash = p.path.find('#'); hash != std::string::npos) p.path.resize(hash);
  if (authority.find('@') != std::string_view::npos)
    return url_error("a user name or password in the URL");
  std::string_view port;
  if (!authority.empty() && authority[0] == '[') {
    const auto close = authority.find(']');
    if (close == std::string_view::npos) return url_error("an IPv6 address without ']'");
    p.host = std::string(authority.substr(1, close - 1));
    auto after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return url_error("text after the IPv6 address");
      port = after.substr(1);
    }
  } else {
    const auto colon = authority.rfind(':');
    p.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) port = authority.substr(colon + 1);
  }
  if (p.host.empty()) return url_error("no host in the URL");
  for (char c : p.host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' ||
          c == '_'))
      return url_error(
          "a host name with a character other than letters, digits, '.', '-', '_' or ':'");
  p.port = p.scheme == "https" ? 443 : 80;
  if (!port.empty()) {
    if (port.size() > 5) return url_error("a bad port");
    int v = 0;
    for (char c : port) {
      if (!std::isdigit(static_cast<unsigned char>(c))) return url_error("a bad port");
      v = v * 10 + (c - '0');
    }
    if (v < 1 || v > 65535) return url_error("a bad port");
    p.port = v;
  }
  for (char c : p.path)
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f)
      return url_error("a space or control character in the path");
  return p;
}

std::expected<std::vector<std::uint8_t>, fetch_error> fetch_image(std::string_view url,
                                                                  const fetch_options& opt) {
  auto p = parse_http_url(url);
  if (!p) return std::unexpected(p.error());
  // Resolve once, check every address, then connect to the one checked (a
  // second lookup by the HTTP client could answer differently).
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(p->host.c_str(), nullptr, &hints, &res); rc != 0)
    return fail(fetch_errc::not_found, "cannot resolve " + p->host + ": " + ::gai_strerror(rc));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> hold(res, &::freeaddrinfo);
  std::string chosen;
  for (auto* a = res; a; a = a->ai_next) {
    const auto why = reason_of(a->ai_addr);
    if (!why.empty() && !opt.allow_private)
      return fail(fetch_errc::forbidden_address,
                  "refused: " + p->host + " resolves to " + text_of(a->ai_addr) + ", a " + why +
                      " address (only public addresses are fetched)");
    if (chosen.empty()) chosen = text_of(a->ai_addr);
  }
  if (chosen.empty()) return fail(fetch_errc::not_found, "cannot resolve " + p->host);
  httplib::Client cli(p->scheme + "://" +
                      (p->host.find(':') != std::string::npos ? "[" + p->host + "]" : p->host) +
                      ":" + std::to_string(p->port));
  if (!cli.is_valid()) return fail(fetch_errc::io, "cannot make a client for " + p->host);
  cli.set_hostname_addr_map({{p->host, chosen}});
  cli.set_connection_timeout(opt.timeout_s, 0);
  cli.set_read_timeout(opt.timeout_s, 0);
  cli.set_write_timeout(opt.timeout_s, 0);
  cli.set_follow_location(false);
  std::vector<std::uint8_t> body;
  bool too_big = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(opt.timeout_s);
  bool late = false;
  int status = 0;
  auto r = cli.Get(
      p->path, httplib::Headers{{"Accept", opt.accept}},
      [&](const httplib::Response& resp) {
        status = resp.status;
        return resp.status == 200;
      },
      [&](const char* data, std::size_t n) {
        if (body.size() + n > opt.max_bytes) {
          too_big = true;
          return false;
        }
        if (std::chrono::steady_clock::now() > deadline) {
          late = true;
          return false;
        }
        body.insert(body.end(), reinterpret_cast<const std::uint8_t*>(data),
                    reinterpret_cast<const std::uint8_t*>(data) + n);
        return true;
      });
  if (too_big)
    return fail(fetch_errc::too_large, "the image at " + p->host + " is larger than " +
                                           std::to_string(opt.max_bytes >> 20) + " MiB");
  if (late)
    return fail(fetch_errc::timeout, "fetching from " + p->host + " took longer than " +
                                         std::to_string(opt.timeout_s) + " s");
  if (status >= 300 && status < 400)
    return fail(fetch_errc::redirect, "the image URL redirects (redirects are not followed)");
  if (status != 0 && status != 200)
    return fail(fetch_errc::bad_status,
                "fetching from " + p->host + ": HTTP " + std::to_string(status));
  if (!r)
    return fail(fetch_errc::io, "fetching from " + p->host + ": " + httplib::to_string(r.error()));
  if (body.empty()) return fail(fetch_errc::empty, "the image at " + p->host + " is empty");
  return body;
}

}  // namespace troupe::serve
