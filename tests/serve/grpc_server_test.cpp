// The gRPC server's port is its own: a second server on it fails to start
// (gRPC's default SO_REUSEPORT would have shared it, as the HTTP gateway
// once did).
#include "serve/grpc_server.hpp"

#include <gtest/gtest.h>

namespace {

TEST(GrpcServer, ASecondServerOnTheSamePortFailsToStart) {
  troupe::serve::grpc_options opt;
  opt.port = 0;
  troupe::serve::grpc_server first(nullptr, opt);
  std::string why;
  ASSERT_TRUE(first.start(why)) << why;
  ASSERT_GT(first.port(), 0);
  opt.port = first.port();
  troupe::serve::grpc_server second(nullptr, opt);
  EXPECT_FALSE(second.start(why));
  EXPECT_NE(why.find(std::to_string(first.port())), std::string::npos) << why;
  first.stop();
  // Once the first is gone, the port is free again.
  troupe::serve::grpc_server third(nullptr, opt);
  EXPECT_TRUE(third.start(why)) << why;
}

}  // namespace
