// ParseChannelArgs (attnd/transport/channel_args.h): the --grpc_arg syntax of attnd and attn.
#include "attnd/transport/channel_args.h"

#include <string>
#include <variant>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace attnd {
namespace {

TEST(ChannelArgs, IntegersStringsAndTheirNames) {
  absl::StatusOr<std::vector<ChannelArg>> a =
      ParseChannelArgs({"grpc.http2.lookahead_bytes=8388608", "grpc.primary_user_agent=attn/1 x", "grpc.x=-3",
                        "grpc.empty=", "grpc.big=99999999999", "grpc.eq=a=b"},
                       "grpc_arg");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 6u);
  EXPECT_EQ((*a)[0].name, "grpc.http2.lookahead_bytes");
  EXPECT_EQ(std::get<int>((*a)[0].value), 8388608);
  EXPECT_EQ(std::get<std::string>((*a)[1].value), "attn/1 x");
  EXPECT_EQ(std::get<int>((*a)[2].value), -3);
  EXPECT_EQ(std::get<std::string>((*a)[3].value), "");
  EXPECT_EQ(std::get<std::string>((*a)[4].value), "99999999999");  // beyond int: passed as text
  EXPECT_EQ((*a)[5].name, "grpc.eq");
  EXPECT_EQ(std::get<std::string>((*a)[5].value), "a=b");  // split at the first '='
  EXPECT_TRUE(SetsChannelArg(*a, "grpc.x"));
  EXPECT_FALSE(SetsChannelArg(*a, "grpc.y"));
  EXPECT_TRUE(ParseChannelArgs({}, "grpc_arg")->empty());
}

TEST(ChannelArgs, MalformedOnesNameTheFlag) {
  for (const char* bad : {"novalue", "=1", "has space=1", ""}) {
    absl::StatusOr<std::vector<ChannelArg>> a = ParseChannelArgs({"grpc.ok=1", bad}, "grpc_arg");
    ASSERT_FALSE(a.ok()) << bad;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(a.status().message(), "grpc_arg: '")) << a.status();
  }
}

}  // namespace
}  // namespace attnd
