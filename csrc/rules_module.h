#pragma once
// railcc._C.rules (rules_module.cpp): registered by the module (module.cpp).
#include <pybind11/pybind11.h>

void registerRules(pybind11::module_& parent);
