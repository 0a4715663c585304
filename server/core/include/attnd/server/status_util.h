// absl::Status is the one error type inside attnd (a frontend turns it into its wire's status: grpc_status.h).
#pragma once

#include "absl/status/status.h"

// Returns early with the status of `expr` when it is not OK (Abseil does not export its own macro).
#define ATTND_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    const ::absl::Status _attnd_status = (expr);     \
    if (!_attnd_status.ok()) return _attnd_status;   \
  } while (0)
