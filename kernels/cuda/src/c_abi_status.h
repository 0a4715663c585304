// The kernels' C ABIs report an error as its status code (the return value) and its text, truncated and
// NUL-terminated, in the caller's buffer.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>

#include "absl/status/status.h"

namespace attnd::kernels {

inline int FailInto(const absl::Status& st, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const std::string msg = st.ToString();
    std::strncpy(err, msg.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return static_cast<int>(st.code());
}

}  // namespace attnd::kernels
