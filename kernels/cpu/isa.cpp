#include "kernels/cpu/isa.hpp"

#include <cpuid.h>

#include <cstdlib>
#include <string>

namespace troupe::kernels::cpu {

std::string_view to_string(isa level) {
  switch (level) {
    case isa::scalar:
      return "scalar";
    case isa::avx2:
      return "avx2";
    case isa::avx512:
      return "avx512";
    case isa::avx512_vnni:
      return "avx512_vnni";
  }
  return "unknown";
}

result<isa> isa_from_string(std::string_view name) {
  for (auto l : {isa::scalar, isa::avx2, isa::avx512, isa::avx512_vnni})
    if (to_string(l) == name) return l;
  return make_error(errc::invalid_argument, "unknown ISA level '" + std::string(name) +
                                                "' (scalar, avx2, avx512, avx512_vnni)");
}

namespace {

std::uint64_t xgetbv0() {
  std::uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (std::uint64_t(edx) << 32) | eax;
}

}  // namespace

isa hardware_isa() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return isa::scalar;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12);
  const bool f16c = c & (1u << 29);
  const bool avx = c & (1u << 28);
  if (!osxsave || !avx) return isa::scalar;
  const std::uint64_t xcr0 = xgetbv0();
  const bool ymm_os = (xcr0 & 0x6) == 0x6;
  const bool zmm_os = (xcr0 & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return isa::scalar;
  const bool avx2 = b & (1u << 5);
  const bool bmi2 = b & (1u << 8);
  const bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31);
  const bool vnni = c & (1u << 11);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5));
  if (!(ymm_os && avx2 && fma && f16c && bmi2)) return isa::scalar;
  if (!(zmm_os && avx512f && avx512dq && avx512bw && avx512vl)) return isa::avx2;
  if (!(vnni && bf16)) return isa::avx512;
  return isa::avx512_vnni;
}

bool full_width_avx512() {
  static const bool full = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return true;
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return true;
    const unsigned base = (a >> 8) & 0xf;
    const unsigned family = base == 0xf ? base + ((a >> 20) & 0xff) : base;
    return family >= 0x1a;  // Zen 5 and later
  }();
  return full;
}

isa detect_isa() {
  const isa hw = hardware_isa();
  if (const char* env = std::getenv("TROUPE_ISA")) {
    if (auto want = isa_from_string(env); want && *want < hw) return *want;
  }
  return hw;
}

}  // namespace troupe::kernels::cpu
