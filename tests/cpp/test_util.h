// Small builders shared by the manager tests.
#pragma once

#include <map>
#include <memory>
#include <numeric>
#include <vector>

#include "kvcache/kv_cache_manager.h"

namespace kvcache::testing {

inline ModelSpec Model(std::int32_t layers, std::vector<std::int32_t> heads = {1}, std::int32_t head_dim = 8) {
  ModelSpec m;
  m.num_layers = layers;
  m.num_kv_heads = std::move(heads);
  m.head_dim = head_dim;
  m.dtype = DType::kFloat16;
  m.kv_factor = 2;
  return m;
}

inline ManagerConfig Config(std::vector<std::int32_t> windows, std::int32_t max_seq_len,
                            std::map<WindowSize, std::int32_t> primary, std::int32_t tpb = 4,
                            BackendKind backend = BackendKind::kHost) {
  ManagerConfig c;
  c.tokens_per_block = tpb;
  c.max_attention_window = std::move(windows);
  c.max_seq_len = max_seq_len;
  c.max_batch_size = 0;
  for (const auto& [w, n] : primary) c.blocks_per_window[w] = WindowBlocks{n, 0};
  c.backend = backend;
  return c;
}

inline std::vector<TokenId> Iota(std::int32_t n, TokenId first = 0) {
  std::vector<TokenId> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

inline void Add(KVCacheManager& m, SeqId id, std::int32_t n) {
  auto t = Iota(n);
  m.AddSequence(id, t.data(), t.size());
}

/// Everything observable about the manager's occupancy, for "nothing changed" checks.
struct Snapshot {
  std::vector<std::int32_t> free;
  std::map<SeqId, std::vector<std::vector<BlockId>>> blocks;
  std::map<SeqId, std::int32_t> tokens;
  std::int64_t alloc_total = 0;

  bool operator==(const Snapshot& o) const {
    return free == o.free && blocks == o.blocks && tokens == o.tokens && alloc_total == o.alloc_total;
  }
};

inline Snapshot Take(const KVCacheManager& m, const std::vector<SeqId>& ids) {
  Snapshot s;
  for (auto w : m.window_sizes()) s.free.push_back(m.GetNumFreeBlocks(w));
  for (auto id : ids) {
    if (!m.HasSequence(id)) continue;
    s.tokens[id] = m.NumTokens(id);
    for (auto w : m.window_sizes()) s.blocks[id].push_back(m.GetCacheBlockIds(id, w));
  }
  s.alloc_total = m.GetStats().alloc_total_blocks;
  return s;
}

}  // namespace kvcache::testing
