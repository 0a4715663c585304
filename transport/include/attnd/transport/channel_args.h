// Extra gRPC channel arguments from the command line (`--grpc_arg=name=value` on attnd and attn), for
// tuning the transport without a rebuild: HTTP/2 windows and frame sizes, keepalive, read chunk sizes.
// Names are gRPC's own (grpc/impl/grpc_types.h, e.g. grpc.http2.lookahead_bytes); they are applied after
// attnd's settings, so they override them.
#pragma once

#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnd {

struct ChannelArg {
  std::string name;
  std::variant<int, std::string> value;  // an integer when the text is one, else the text
};

// Each spec is "name=value" (name non-empty and without spaces). Errors name `flag`.
absl::StatusOr<std::vector<ChannelArg>> ParseChannelArgs(const std::vector<std::string>& specs, absl::string_view flag);

// Whether `args` sets `name`. gRPC does not promise which of two values of one argument it uses, so a
// setting the user gives replaces ours rather than joining it.
bool SetsChannelArg(const std::vector<ChannelArg>& args, absl::string_view name);

}  // namespace attnd
