// Hashing throughput of the block keys: ChainHashes over 4k- and 32k-token prompts (32-token
// blocks, no extras) and HashTokens over 1M tokens. Prints the median over 21 repetitions;
// never asserts. Build: -DKVCACHE_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "kvcache/block_key.h"

namespace {

using Clock = std::chrono::steady_clock;

volatile std::uint64_t g_sink = 0;  // keeps the work observable

/// Median seconds of one call of `fn`, each sample timing `inner` calls.
double MedianSeconds(const std::function<void()>& fn, int reps, int inner) {
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < inner; ++i) fn();
    const std::chrono::duration<double> dt = Clock::now() - t0;
    samples.push_back(dt.count() / inner);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

void Report(const char* what, std::size_t tokens, double seconds) {
  std::printf("%-34s %10zu %12.2f %14.3e %10.2f\n", what, tokens, seconds * 1e6,
              static_cast<double>(tokens) / seconds,
              static_cast<double>(tokens) * sizeof(kvcache::TokenId) / seconds / 1e9);
}

}  // namespace

int main() {
  constexpr int kReps = 21;
  std::mt19937_64 rng(2024);
  std::uniform_int_distribution<kvcache::TokenId> token(0, 151935);
  std::vector<kvcache::TokenId> tokens(1 << 20);
  for (kvcache::TokenId& t : tokens) t = token(rng);

  std::printf("%-34s %10s %12s %14s %10s\n", "case (median of 21)", "tokens", "us/call",
              "tokens/s", "GB/s");
  const kvcache::ReuseExtras none;
  std::vector<std::uint64_t> out;
  for (std::size_t n : {std::size_t{4096}, std::size_t{32768}}) {
    const int inner = n < 10000 ? 200 : 25;
    const double s = MedianSeconds(
        [&] {
          kvcache::ChainHashes(tokens.data(), n, 32, none, &out);
          g_sink = g_sink + out.back();
        },
        kReps, inner);
    Report(n < 10000 ? "ChainHashes 4k, 32-token blocks" : "ChainHashes 32k, 32-token blocks", n,
           s);
  }
  kvcache::ReuseExtras lora;
  lora.lora_task_id = 7;
  lora.cache_salt = 99;
  {
    const double s = MedianSeconds(
        [&] {
          kvcache::ChainHashes(tokens.data(), 32768, 32, lora, &out);
          g_sink = g_sink + out.back();
        },
        kReps, 25);
    Report("ChainHashes 32k, LoRA + salt", 32768, s);
  }
  kvcache::ReuseExtras images;  // 16 images of 576 tokens spread over the prompt
  for (std::int32_t i = 0; i < 16; ++i) {
    images.multimodal.push_back({1000u + static_cast<std::uint64_t>(i), 100 + 2048 * i, 576});
  }
  {
    const double s = MedianSeconds(
        [&] {
          kvcache::ChainHashes(tokens.data(), 32768, 32, images, &out);
          g_sink = g_sink + out.back();
        },
        kReps, 25);
    Report("ChainHashes 32k, 16 images", 32768, s);
  }
  {
    const double s = MedianSeconds(
        [&] { g_sink = g_sink + kvcache::HashTokens(1, tokens.data(), tokens.size()); }, kReps,
        4);
    Report("HashTokens 1M", tokens.size(), s);
  }
  return 0;
}
