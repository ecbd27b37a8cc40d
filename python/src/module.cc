// kvstream._kvstream: the extension module the kvstream package re-exports.
#include <nanobind/nanobind.h>

#include "errors.h"
#include "objects.h"

namespace nb = nanobind;

NB_MODULE(_kvstream, m) {
  m.doc() = "kvstream's C++ API: caches, attention, the connector's two sides.";
  kvstream::python::BindErrors(m);
  kvstream::python::BindCaches(m);
  kvstream::python::BindAttention(m);
  kvstream::python::BindConnector(m);
  kvstream::python::BindConnectorMessages(m);
#ifdef KVSTREAM_PYTHON_HAVE_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
}
