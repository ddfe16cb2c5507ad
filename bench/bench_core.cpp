// The manager's core calls without Python: the prepared 2,500-token miss (add_sequence alone,
// then remove_sequence alone), the retry of a deferred admission and one decode step of 256
// sequences, on the set-up of bench_manager.py (windows {512, full}, 32-token blocks, 40,000
// blocks per window, reuse on, virtual backend). Prints medians (per call, or per sequence and
// step); never asserts. Build: -DKVCACHE_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "kvcache/kv_cache_manager.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvcache::KVCacheManager;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Ns(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::nano>(t1 - t0).count();
}

KVCacheManager MakeManager(std::int32_t window, std::int32_t blocks, std::int32_t layers) {
  kvcache::ModelSpec model;
  model.num_layers = layers;
  model.num_kv_heads = {8};
  model.head_dim = 128;
  model.dtype = kvcache::DType::kBFloat16;
  kvcache::ManagerConfig c;
  c.tokens_per_block = 32;
  c.max_attention_window = {window, 8192};
  c.max_seq_len = 8192;
  c.max_batch_size = 4096;
  c.blocks_per_window[window] = kvcache::WindowBlocks{blocks, 0};
  c.blocks_per_window[8192] = kvcache::WindowBlocks{blocks, 0};
  c.backend = kvcache::BackendKind::kVirtual;
  c.enable_block_reuse = true;
  return KVCacheManager(model, c);
}

std::vector<kvcache::TokenId> Random(std::mt19937& rng, std::size_t n) {
  std::uniform_int_distribution<kvcache::TokenId> token(0, 31999);
  std::vector<kvcache::TokenId> t(n);
  for (auto& x : t) x = token(rng);
  return t;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  {
    KVCacheManager m = MakeManager(512, 40000, 2);
    // Shared, as the Python binding passes them: the sequence keeps the prompt, copying nothing.
    std::vector<std::shared_ptr<const kvcache::PreparedPrompt>> prompts;
    for (int i = 0; i < 4; ++i) {
      const auto t = Random(rng, 2500);
      prompts.push_back(std::make_shared<const kvcache::PreparedPrompt>(m.Prepare(t.data(), t.size(), {})));
    }
    std::vector<double> add;
    std::vector<double> remove;
    for (int i = 0; i < 20000; ++i) {
      const auto t0 = Clock::now();
      m.AddSequence(i, prompts[static_cast<std::size_t>(i % 4)]);
      const auto t1 = Clock::now();
      m.RemoveSequence(i, /*store_for_reuse=*/false);
      const auto t2 = Clock::now();
      add.push_back(Ns(t0, t1));
      remove.push_back(Ns(t1, t2));
    }
    std::printf("%-52s %8.2f us\n", "add_sequence, prepared 2,500-token miss", Median(add) / 1000);
    std::printf("%-52s %8.2f us\n", "remove_sequence of it (store_for_reuse=False)", Median(remove) / 1000);
  }
  {
    KVCacheManager m = MakeManager(512, 40000, 2);
    auto system = Random(rng, 1024);
    m.AddSequence(0, system.data(), system.size());
    m.RemoveSequence(0);
    auto rest = Random(rng, 1500);
    system.insert(system.end(), rest.begin(), rest.end());
    const kvcache::PreparedPrompt q = m.Prepare(system.data(), system.size(), {});
    std::vector<double> retry;
    for (int i = 0; i < 20000; ++i) {
      const auto t0 = Clock::now();
      m.GetNumBlocksToAllocate(q);
      retry.push_back(Ns(t0, Clock::now()));
    }
    std::printf("%-52s %8.2f us\n", "admission retry (prepared, 1,024-token hit)", Median(retry) / 1000);
  }
  {
    const std::int32_t batch = 256;
    const int steps = 2000;
    KVCacheManager m = MakeManager(128, batch * ((400 + steps) / 32 + 2), 24);
    std::vector<kvcache::SeqId> ids(batch);
    for (std::int32_t i = 0; i < batch; ++i) {
      const auto t = Random(rng, static_cast<std::size_t>(100 + (i * 7) % 300));
      m.AddSequence(i, t.data(), t.size());
      ids[static_cast<std::size_t>(i)] = i;
    }
    const std::vector<kvcache::TokenId> tokens(batch, 5);
    std::vector<double> step;
    for (int s = 0; s < steps; ++s) {
      const auto t0 = Clock::now();
      m.AddTokens(ids.data(), tokens.data(), ids.size());
      step.push_back(Ns(t0, Clock::now()) / batch);
    }
    std::printf("%-52s %8.1f ns/seq/step\n", "add_tokens, batch 256, windows {128, full}", Median(step));
  }
  return 0;
}
