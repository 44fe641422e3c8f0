// NumpyRandomState (csrc/core/numpy_random.h) against numbers numpy printed:
// numpy.random.RandomState(seed).randint(1_000_000_000), the seeds torch's
// PowerSGD hook draws for its random Q. (The Python tests compare 700 draws
// per seed against numpy itself.)
#include <catch2/catch.hpp>

#include <array>
#include <cstdint>

#include "core/numpy_random.h"

using fastddp::NumpyRandomState;

TEST_CASE("randint(1e9) draws numpy's legacy RandomState numbers", "[numpy_random]") {
  struct Case {
    uint32_t seed;
    int64_t first, second;
  };
  const Case cases[] = {{0, 209652396, 398764591},
                        {1, 717354021, 946286476},
                        {42, 534895718, 199900595},
                        {4294967295u, 419326371, 479346978}};
  for (const Case& c : cases) {
    NumpyRandomState rng(c.seed);
    CHECK(rng.randint(1000000000) == c.first);
    CHECK(rng.randint(1000000000) == c.second);
  }
  CHECK(NumpyRandomState(3).randint(1) == 0);  // numpy: randint(1) is always 0
}
