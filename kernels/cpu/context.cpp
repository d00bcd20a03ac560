#include "kernels/cpu/context.hpp"

#include <omp.h>

namespace troupe::kernels::cpu {

std::unique_ptr<context> context::create(int threads, std::vector<int> cores,
                                         std::size_t pool_limit_bytes) {
  std::unique_ptr<context> ctx(new context());
  ctx->pool_ = std::make_unique<thread_pool>(threads, std::move(cores));
  ctx->memory_ = memory_pool::create(pool_limit_bytes);
  ctx->hardware_ = hardware_isa();
  ctx->level_ = detect_isa();
  return ctx;
}

void context::prepare_onednn_thread() const {
  omp_set_num_threads(pool_->size());
}

}  // namespace troupe::kernels::cpu
