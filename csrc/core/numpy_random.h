// numpy's legacy RandomState generator (MT19937) and its randint(high), torch-free.
//
// torch's PowerSGD hook seeds each random initialization of Q with
// `torch.manual_seed(state.rng.randint(1_000_000_000))`, where state.rng is
// `numpy.random.RandomState(random_seed)`. Reproducing that draw exactly is
// what makes the native hook's Q equal to torch's; this mirrors numpy's
// `mt19937_seed` (the reference init_genrand), `genrand_int32`, and the
// masked rejection sampling legacy randint uses for ranges below 2**32.
// Own code rather than std::mt19937 so that a state taken from numpy
// (`RandomState.get_state()`: 624 words and a position) can be resumed.
#pragma once

#include <array>
#include <cstdint>

namespace fastddp {

class NumpyRandomState {
 public:
  static constexpr int kN = 624;

  explicit NumpyRandomState(uint32_t seed = 0) { seed_with(seed); }

  // numpy's mt19937_seed: RandomState(seed) for an integer seed.
  void seed_with(uint32_t seed) {
    for (int i = 0; i < kN; ++i) {
      key_[i] = seed;
      seed = 1812433253u * (seed ^ (seed >> 30)) + static_cast<uint32_t>(i + 1);
    }
    pos_ = kN;
  }

  // Resumes from RandomState.get_state()[1] and [2].
  void set_state(const std::array<uint32_t, kN>& key, int pos) {
    key_ = key;
    pos_ = pos;
  }

  const std::array<uint32_t, kN>& key() const { return key_; }
  int pos() const { return pos_; }

  uint32_t next_uint32() {
    if (pos_ >= kN) regenerate();
    uint32_t y = key_[pos_++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
  }

  // RandomState.randint(high) for 0 < high <= 2**32: the smallest all-ones
  // mask covering high - 1, and draws above high - 1 rejected.
  int64_t randint(int64_t high) {
    const uint32_t range = static_cast<uint32_t>(high - 1);
    if (range == 0) return 0;
    uint32_t mask = range;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    uint32_t value;
    do {
      value = next_uint32() & mask;
    } while (value > range);
    return value;
  }

 private:
  void regenerate() {
    constexpr uint32_t kUpper = 0x80000000u, kLower = 0x7fffffffu, kMatrixA = 0x9908b0dfu;
    for (int i = 0; i < kN; ++i) {
      const uint32_t y = (key_[i] & kUpper) | (key_[(i + 1) % kN] & kLower);
      key_[i] = key_[(i + 397) % kN] ^ (y >> 1) ^ ((y & 1u) ? kMatrixA : 0u);
    }
    pos_ = 0;
  }

  std::array<uint32_t, kN> key_{};
  int pos_ = kN;
};

}  // namespace fastddp
