#include <nanobind/nanobind.h>
#include "attention.h"
namespace nb = nanobind;
NB_MODULE(_C, m) {
  m.def("version", &tokenlake::version);
}
