// How absl::Status errors reach Python: every non-OK Status raised by the bindings becomes
// an exception of the class that names its code (kvstream.NotFoundError for NOT_FOUND, ...),
// all subclasses of kvstream.KvstreamError, with the Status message as the exception
// message. The classes carry `code` (absl's name, "NOT_FOUND") and `code_value` (5).
//
//   ThrowIfError(worker->StartLoadKv());                        // raises on error
//   std::unique_ptr<KvCache> c = Unwrap(KvCache::Borrow(...));  // value or raise
//
// Throw only with the GIL held or released alike: the exception is a C++ StatusError that
// nanobind's translator (registered by BindErrors) turns into the Python exception once the
// call returns to the interpreter, with the GIL held again.
#ifndef KVSTREAM_PYTHON_ERRORS_H_
#define KVSTREAM_PYTHON_ERRORS_H_

#include <exception>
#include <string>
#include <utility>

#include <nanobind/nanobind.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvstream::python {

// The C++ carrier of a non-OK Status on its way to Python.
class StatusError : public std::exception {
 public:
  explicit StatusError(absl::Status status)
      : status_(std::move(status)), what_(status_.ToString()) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

// REQUIRES: !status.ok().
[[noreturn]] inline void ThrowStatus(absl::Status status) { throw StatusError(std::move(status)); }

inline void ThrowIfError(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}

template <typename T>
T Unwrap(absl::StatusOr<T> value) {
  if (!value.ok()) ThrowStatus(value.status());
  return *std::move(value);
}

// Creates KvstreamError and its subclasses in `m` and registers the translator.
void BindErrors(nanobind::module_& m);

}  // namespace kvstream::python

#endif  // KVSTREAM_PYTHON_ERRORS_H_
