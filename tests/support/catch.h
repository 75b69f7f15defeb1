// One include for Catch2 2.x (Debian 12) and 3.x (Ubuntu 24.04).
#pragma once
#if MOETRAIN_CATCH2_V3
#include <catch2/catch_all.hpp>
using Catch::Approx;  // Catch2 2.x has it at global scope
#else
#include <catch2/catch.hpp>
#endif
