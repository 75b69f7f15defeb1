// Catch2 3 brings its own main (Catch2::Catch2WithMain); Catch2 2 needs this translation unit.
#if !MOETRAIN_CATCH2_V3
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
#endif
