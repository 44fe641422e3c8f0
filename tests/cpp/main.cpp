// The Catch2 runner for the C++ tests; the test cases live in the other files here.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
