#include "attnd/transport/channel_args.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace attnd {

absl::StatusOr<std::vector<ChannelArg>> ParseChannelArgs(const std::vector<std::string>& specs, absl::string_view flag) {
  std::vector<ChannelArg> out;
  for (const std::string& spec : specs) {
    const size_t eq = spec.find('=');
    const absl::string_view name = absl::string_view(spec).substr(0, eq);
    bool bad = eq == std::string::npos || name.empty();
    for (char c : name) bad |= absl::ascii_isspace(static_cast<unsigned char>(c));
    if (bad) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": '", spec, "' is not name=value (e.g. grpc.http2.lookahead_bytes=8388608)"));
    }
    ChannelArg arg;
    arg.name = std::string(name);
    const std::string value = spec.substr(eq + 1);
    int n = 0;
    if (absl::SimpleAtoi(value, &n)) {
      arg.value = n;
    } else {
      arg.value = value;
    }
    out.push_back(std::move(arg));
  }
  return out;
}

bool SetsChannelArg(const std::vector<ChannelArg>& args, absl::string_view name) {
  for (const ChannelArg& a : args) {
    if (a.name == name) return true;
  }
  return false;
}

}  // namespace attnd
