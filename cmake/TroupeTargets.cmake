# Warning and sanitizer settings shared by every project target.
add_library(troupe_options INTERFACE)
target_compile_options(troupe_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wno-error=deprecated-declarations>
  # g++ 12 at -O3 reports -Wrestrict false positives inside std::string
  # concatenation (GCC PR 105329); the warning is off until g++ 13.
  $<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>)
if(TROUPE_SANITIZE)
  target_compile_options(troupe_options INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer>)
  target_link_options(troupe_options INTERFACE -fsanitize=address,undefined)
endif()
if(TROUPE_TSAN)
  target_compile_options(troupe_options INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=thread -fno-omit-frame-pointer>)
  target_link_options(troupe_options INTERFACE -fsanitize=thread)
endif()

# Sources named *_avx2.cpp / *_avx512.cpp get the ISA flags for that file
# only; the runtime dispatcher picks them after checking cpuid.
function(troupe_isa_sources)
  foreach(src ${ARGN})
    if(src MATCHES "_avx2\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mf16c;-mbmi2")
    elseif(src MATCHES "_avx512\\.cpp$")
      set_source_files_properties(${src} PROPERTIES COMPILE_OPTIONS
        "-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq;-mavx512vnni;-mavx512bf16;-mfma;-mf16c;-mbmi2")
    endif()
  endforeach()
endfunction()
