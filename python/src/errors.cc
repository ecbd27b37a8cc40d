// The exception classes of kvstream.errors.h, one per absl::StatusCode.
#include "errors.h"

#include <Python.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace nb = nanobind;

namespace kvstream::python {
namespace {

struct ErrorClass {
  absl::StatusCode code;
  const char* name;
  // A Python built-in the class also derives from, where one means the same thing, so that
  // code catching ValueError or TimeoutError catches kvstream's too; null: none.
  PyObject* builtin;
};

// Indexed by code value (OK = 0 has no class). Filled by BindErrors, which holds the GIL;
// read by the translator, which does too. The classes live as long as the module.
PyObject* g_classes[17] = {};
PyObject* g_base = nullptr;

void Translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const StatusError& e) {
    const int code = static_cast<int>(e.status().code());
    PyObject* cls = (code > 0 && code < 17 && g_classes[code] != nullptr) ? g_classes[code] : g_base;
    const std::string message(e.status().message());
    PyErr_SetString(cls, message.c_str());
  }
}

}  // namespace

void BindErrors(nb::module_& m) {
  const ErrorClass classes[] = {
      {absl::StatusCode::kCancelled, "CancelledError", nullptr},
      {absl::StatusCode::kUnknown, "UnknownError", nullptr},
      {absl::StatusCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError},
      {absl::StatusCode::kDeadlineExceeded, "DeadlineExceededError", PyExc_TimeoutError},
      {absl::StatusCode::kNotFound, "NotFoundError", PyExc_LookupError},
      {absl::StatusCode::kAlreadyExists, "AlreadyExistsError", nullptr},
      {absl::StatusCode::kPermissionDenied, "PermissionDeniedError", nullptr},
      {absl::StatusCode::kResourceExhausted, "ResourceExhaustedError", nullptr},
      {absl::StatusCode::kFailedPrecondition, "FailedPreconditionError", nullptr},
      {absl::StatusCode::kAborted, "AbortedError", nullptr},
      {absl::StatusCode::kOutOfRange, "OutOfRangeError", PyExc_IndexError},
      {absl::StatusCode::kUnimplemented, "UnimplementedError", PyExc_NotImplementedError},
      {absl::StatusCode::kInternal, "InternalError", nullptr},
      {absl::StatusCode::kUnavailable, "UnavailableError", nullptr},
      {absl::StatusCode::kDataLoss, "DataLossError", nullptr},
      {absl::StatusCode::kUnauthenticated, "UnauthenticatedError", nullptr},
  };
  // Exceptions show as kvstream.X: the package re-exports them from kvstream._kvstream.
  g_base = PyErr_NewExceptionWithDoc(
      "kvstream.KvstreamError",
      "A kvstream operation failed. `code` names the absl::StatusCode (None here, the "
      "subclasses set it); the message is the Status message.",
      PyExc_Exception, nullptr);
  if (g_base == nullptr) throw nb::python_error();
  PyObject_SetAttrString(g_base, "code", Py_None);
  PyObject_SetAttrString(g_base, "code_value", Py_None);
  m.attr("KvstreamError") = nb::handle(g_base);
  for (const ErrorClass& c : classes) {
    const std::string qualified = absl::StrCat("kvstream.", c.name);
    const std::string code_name = absl::StatusCodeToString(c.code);
    const std::string doc = absl::StrCat("A kvstream operation failed with status ", code_name, ".");
    PyObject* bases = c.builtin != nullptr ? PyTuple_Pack(2, g_base, c.builtin)
                                           : PyTuple_Pack(1, g_base);
    if (bases == nullptr) throw nb::python_error();
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc.c_str(), bases, nullptr);
    Py_DECREF(bases);
    if (cls == nullptr) throw nb::python_error();
    nb::handle h(cls);
    h.attr("code") = nb::str(code_name.c_str());
    h.attr("code_value") = nb::int_(static_cast<int>(c.code));
    g_classes[static_cast<int>(c.code)] = cls;
    m.attr(c.name) = h;
  }
  nb::register_exception_translator(&Translate);
}

}  // namespace kvstream::python
