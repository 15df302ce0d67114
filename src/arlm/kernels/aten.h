// ATen for the kernels: the real headers, or (ARLM_BARE: the decode library a process without
// torch loads, bare_api.cpp) the views and helpers of bare_aten.h.
#pragma once
#ifdef ARLM_BARE
#include "bare_aten.h"
#else
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#endif
