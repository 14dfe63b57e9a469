// Umbrella header for C++ users of fastmha: the functional ops, the C++ module and build information.
#pragma once

#include <fastmha/build_info.h>
#include <fastmha/cpu_buffers.h>
#include <fastmha/module.h>
#include <fastmha/ops.h>
#include <fastmha/serialize.h>
