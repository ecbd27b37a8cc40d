// Status plumbing used at every kvstream boundary.
//
//   absl::Status Load() {
//     RETURN_IF_ERROR(Check());
//     ASSIGN_OR_RETURN(auto blocks, pool.Allocate(4));
//     ...
//   }
//
// The macros evaluate their argument exactly once. They are defined only if no other
// library already defined macros of the same names (the semantics are the usual ones).
#ifndef KVSTREAM_COMMON_STATUS_MACROS_H_
#define KVSTREAM_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVSTREAM_CONCAT_INNER_(a, b) a##b
#define KVSTREAM_CONCAT_(a, b) KVSTREAM_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define KVSTREAM_RETURN_IF_ERROR(expr)                  \
  do {                                                  \
    ::absl::Status kvstream_status_ = (expr);           \
    if (!kvstream_status_.ok()) return kvstream_status_; \
  } while (false)

#define KVSTREAM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return std::move(tmp).status();        \
  lhs = std::move(tmp).value()

// Evaluates `expr` (an absl::StatusOr<T>); on error returns its status, else moves the
// value into `lhs`, which may be a declaration (`ASSIGN_OR_RETURN(auto x, F())`).
#define KVSTREAM_ASSIGN_OR_RETURN(lhs, expr) \
  KVSTREAM_ASSIGN_OR_RETURN_IMPL_(KVSTREAM_CONCAT_(kvstream_statusor_, __LINE__), lhs, expr)

#ifndef RETURN_IF_ERROR
#define RETURN_IF_ERROR(expr) KVSTREAM_RETURN_IF_ERROR(expr)
#endif
#ifndef ASSIGN_OR_RETURN
#define ASSIGN_OR_RETURN(lhs, expr) KVSTREAM_ASSIGN_OR_RETURN(lhs, expr)
#endif

#endif  // KVSTREAM_COMMON_STATUS_MACROS_H_
