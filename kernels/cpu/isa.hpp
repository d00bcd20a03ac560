#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/status.hpp"

namespace troupe::kernels::cpu {

/// Instruction-set levels of the CPU backend, in increasing order. Each
/// level implies the ones below it.
enum class isa : std::uint8_t {
  scalar = 0,       ///< portable C++ (the reference)
  avx2 = 1,         ///< AVX2 + FMA + F16C
  avx512 = 2,       ///< AVX-512 F/BW/VL/DQ
  avx512_vnni = 3,  ///< + VNNI (vpdpbusd) and BF16
};

std::string_view to_string(isa level);
result<isa> isa_from_string(std::string_view name);

/// The best level this CPU and OS support (cpuid + xgetbv), capped by the
/// environment variable TROUPE_ISA when it names a lower level.
isa detect_isa();

/// The best level this CPU and OS support, ignoring TROUPE_ISA.
isa hardware_isa();

/// Whether this CPU executes a 512-bit FMA at full width (Intel's AVX-512
/// cores; AMD from Zen 5). Zen 4 runs it as two 256-bit halves: there the
/// float matmul measured ~10 % slower on zmm than on ymm, so it stays on
/// AVX2 (the same bits either way).
bool full_width_avx512();

/// The level kernels actually run at: `requested`, lowered to the best
/// level that both the hardware supports and the kernel has an
/// implementation for (`implemented`).
inline isa effective_isa(isa requested, isa implemented) {
  return requested < implemented ? requested : implemented;
}

}  // namespace troupe::kernels::cpu
