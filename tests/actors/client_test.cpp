// The one client: a request open when its scheduler (or head) goes away
// ends at once with an `unavailable` error instead of waiting forever, and
// later submits are refused with the same code.
#include "actors/client.hpp"

#include <gtest/gtest.h>

#include <future>

#include "tests/actors/actor_test.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;

TEST(Client, AnOpenRequestEndsWhenItsSchedulerGoesAway) {
  caf::actor_system sys{test::actor_config()};
  auto sched = test::idle_scheduler(sys);
  client c(sys, sched);
  generate_request req;
  req.id = client::next_id();
  req.prompt_tokens = {1, 2, 3};
  auto run = std::async(std::launch::async, [&] { return c.run(req); });
  EXPECT_EQ(run.wait_for(200ms), std::future_status::timeout) << "accepted, never answered";
  caf::anon_send_exit(sched, caf::exit_reason::kill);
  ASSERT_EQ(run.wait_for(10s), std::future_status::ready) << "the client waited forever";
  auto f = run.get();
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(f->reason, finish_reason::error);
  EXPECT_EQ(f->code, error_code::unavailable);
  EXPECT_NE(f->error.find("the scheduler went away"), std::string::npos) << f->error;
  req.id = client::next_id();
  auto later = c.submit(req, {});
  ASSERT_FALSE(later);
  EXPECT_EQ(later.error().code, error_code::unavailable);
}

TEST(Client, RefusesTheWrongKindOfRequestAndAMissingTarget) {
  caf::actor_system sys{test::actor_config()};
  client none(sys, frontdoor_actor{});
  auto r = none.submit(job_request{}, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, error_code::unavailable);
  auto wrong = none.submit(generate_request{}, {});
  ASSERT_FALSE(wrong);
  EXPECT_EQ(wrong.error().code, error_code::invalid_request);
  EXPECT_FALSE(none.cancel(1));
}

}  // namespace
}  // namespace troupe::actors
