// ResetPrefixCache: refused (nothing changed) while a sequence is registered or a block is
// pinned; otherwise every cached prefix leaves the tree in every window and tier, with removed
// events naming exactly what was stored.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

ManagerConfig ResetConfig(std::vector<std::int32_t> windows, std::map<WindowSize, std::int32_t> primary,
                          std::int32_t secondary = 0) {
  ManagerConfig c = Config(std::move(windows), 64, primary);
  for (auto& kv : c.blocks_per_window) kv.second.secondary = secondary;
  c.enable_block_reuse = true;
  c.event_buffer_max_size = 1000;
  return c;
}

std::int32_t Add(KVCacheManager& m, SeqId id, const std::vector<TokenId>& tokens) {
  return m.AddSequence(id, tokens.data(), tokens.size(), {});
}

std::int32_t Reusable(const KVCacheManager& m, const std::vector<TokenId>& tokens) {
  return m.GetReusablePrefixLength(tokens.data(), tokens.size(), {});
}

/// Block hashes per window named by the stored and the removed events taken now, sorted.
struct Hashes {
  std::map<WindowSize, std::vector<std::uint64_t>> stored;
  std::map<WindowSize, std::vector<std::uint64_t>> removed;
  std::vector<std::pair<int, int>> moves;  ///< updated events' cache level changes
};

Hashes TakeHashes(KVCacheManager& m) {
  Hashes h;
  for (const KVCacheEvent& e : m.GetLatestEvents(0)) {
    if (e.kind == EventKind::kStored) {
      for (const StoredBlock& b : e.blocks) h.stored[e.window_size].push_back(b.hash);
    } else if (e.kind == EventKind::kRemoved) {
      auto& out = h.removed[e.window_size];
      out.insert(out.end(), e.hashes.begin(), e.hashes.end());
    } else if (e.kind == EventKind::kUpdated && e.cache_level.has_value()) {
      h.moves.push_back(*e.cache_level);
    }
  }
  for (auto* per_window : {&h.stored, &h.removed}) {
    for (auto& [w, v] : *per_window) std::sort(v.begin(), v.end());
  }
  return h;
}

TEST(ResetPrefixCacheTest, RefusedWithALiveSequenceThenDropsEveryPrefix) {
  KVCacheManager m(Model(1), ResetConfig({}, {{64, 8}}));
  const auto prompt = Iota(13);
  EXPECT_EQ(Add(m, 1, prompt), 0);
  EXPECT_EQ(m.StoreContextBlocks(1), 3);  // 12 key tokens: three full blocks
  EXPECT_EQ(Reusable(m, prompt), 12);
  const Hashes stored = TakeHashes(m);
  ASSERT_EQ(stored.stored.at(64).size(), 3u);
  EXPECT_TRUE(stored.removed.empty());

  EXPECT_FALSE(m.ResetPrefixCache());  // sequence 1 still runs: nothing changes
  EXPECT_EQ(Reusable(m, prompt), 12);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 3);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 8 - 4);
  EXPECT_TRUE(m.GetLatestEvents(0).empty());
  m.CheckInvariants();

  m.RemoveSequence(1);  // stores nothing new
  EXPECT_TRUE(TakeHashes(m).stored.empty());
  EXPECT_EQ(Reusable(m, prompt), 12);
  EXPECT_TRUE(m.ResetPrefixCache());
  EXPECT_EQ(Reusable(m, prompt), 0);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 8);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 0);
  EXPECT_EQ(m.GetStats().free_num_blocks, 8);
  EXPECT_TRUE(m.CachedBlockHashes(64).empty());
  const Hashes removed = TakeHashes(m);
  EXPECT_EQ(removed.removed, stored.stored);
  m.CheckInvariants();

  EXPECT_TRUE(m.ResetPrefixCache());  // nothing left: no event
  EXPECT_TRUE(m.GetLatestEvents(0).empty());
  EXPECT_EQ(Add(m, 2, prompt), 0);  // a miss, recomputed and stored again
  EXPECT_EQ(m.GetStats().reused_blocks, 0);
  m.RemoveSequence(2);
  EXPECT_EQ(Reusable(m, prompt), 12);
  m.CheckInvariants();
}

TEST(ResetPrefixCacheTest, APinnedBlockRefuses) {
  KVCacheManager m(Model(1), ResetConfig({}, {{64, 8}}));
  const auto prompt = Iota(9);
  Add(m, 1, prompt);
  const auto pinned = m.PinBlocks(1);
  EXPECT_EQ(pinned.at(64), (std::vector<BlockId>{0, 1}));
  m.RemoveSequence(1);
  TakeHashes(m);
  EXPECT_FALSE(m.ResetPrefixCache());
  EXPECT_EQ(Reusable(m, prompt), 8);
  EXPECT_EQ(m.GetNumUsedBlocks(64), 2);
  EXPECT_TRUE(m.GetLatestEvents(0).empty());
  m.CheckInvariants();
  m.UnpinBlocks(pinned);
  EXPECT_TRUE(m.ResetPrefixCache());
  EXPECT_EQ(Reusable(m, prompt), 0);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 8);
  m.CheckInvariants();
}

TEST(ResetPrefixCacheTest, OffloadedAndDiskBlocksGoToo) {
  ManagerConfig c = ResetConfig({}, {{64, 4}}, /*secondary=*/1);
  c.disk_blocks_per_window[64] = 4;
  KVCacheManager m(Model(1), c);
  const auto a = Iota(9);
  Add(m, 1, a);
  m.RemoveSequence(1);  // A's two full blocks cached in primary blocks 0, 1
  // B takes scratch blocks 2, 3, then evicts 1 (offloaded to the host block) and 0 (offloaded
  // to the host block, whose content moves to disk first).
  const auto b = Iota(13, 100);
  Add(m, 2, b);
  EXPECT_EQ(m.GetStats().offloaded_blocks, 2);
  m.RemoveSequence(2);  // B's three full blocks cached in primary
  EXPECT_EQ(Reusable(m, a), 8);  // from the host and disk tiers
  EXPECT_EQ(Reusable(m, b), 12);
  const Hashes stored = TakeHashes(m);
  ASSERT_EQ(stored.stored.at(64).size(), 5u);
  EXPECT_EQ(stored.moves, (std::vector<std::pair<int, int>>{{0, 1}, {1, 2}, {0, 1}}));
  EXPECT_EQ(m.CachedBlockHashes(64), stored.stored.at(64));

  EXPECT_TRUE(m.ResetPrefixCache());
  EXPECT_EQ(TakeHashes(m).removed, stored.stored);
  EXPECT_TRUE(m.CachedBlockHashes(64).empty());
  EXPECT_EQ(m.GetNumFreeBlocks(64), 4);
  m.CheckInvariants();
  EXPECT_EQ(Add(m, 3, a), 0);
  EXPECT_EQ(m.GetStats().onboarded_blocks, 0);
  m.RemoveSequence(3);
  m.CheckInvariants();
}

class ResetPrefixCacheVswaTest : public ::testing::TestWithParam<SwaReusePolicy> {};

TEST_P(ResetPrefixCacheVswaTest, EveryWindowIsCleared) {
  ManagerConfig c = ResetConfig({8, 0}, {{8, 8}, {64, 16}});
  c.swa_reuse_policy = GetParam();
  KVCacheManager m(Model(2), c);
  const auto prompt = Iota(21);
  Add(m, 1, prompt);
  m.RemoveSequence(1);
  EXPECT_EQ(Reusable(m, prompt), 20);
  const Hashes stored = TakeHashes(m);
  ASSERT_EQ(stored.stored.size(), 2u);
  EXPECT_EQ(stored.stored.at(64).size(), 5u);
  EXPECT_FALSE(stored.stored.at(8).empty());

  Add(m, 2, Iota(5, 500));
  EXPECT_FALSE(m.ResetPrefixCache());
  EXPECT_EQ(Reusable(m, prompt), 20);
  m.RemoveSequence(2);
  const Hashes more = TakeHashes(m);  // sequence 2's one full block, in both windows
  std::map<WindowSize, std::vector<std::uint64_t>> all = stored.stored;
  for (auto& [w, v] : all) {
    v.insert(v.end(), more.stored.at(w).begin(), more.stored.at(w).end());
    std::sort(v.begin(), v.end());
  }

  EXPECT_TRUE(m.ResetPrefixCache());
  EXPECT_EQ(TakeHashes(m).removed, all);
  EXPECT_EQ(Reusable(m, prompt), 0);
  EXPECT_EQ(m.GetNumFreeBlocks(8), 8);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 16);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 0);
  m.CheckInvariants();
}

INSTANTIATE_TEST_SUITE_P(Policies, ResetPrefixCacheVswaTest,
                         ::testing::Values(SwaReusePolicy::kPlaceholder, SwaReusePolicy::kInvalidate),
                         [](const ::testing::TestParamInfo<SwaReusePolicy>& param) {
                           return std::string(param.param == SwaReusePolicy::kPlaceholder ? "Placeholder"
                                                                                          : "Invalidate");
                         });

TEST(ResetPrefixCacheTest, LendingStaysConsistent) {
  ManagerConfig c = ResetConfig({4, 0}, {{4, 2}, {64, 6}});
  c.max_seq_len = 16;
  c.blocks_per_window = {{4, {2, 0}}, {16, {6, 0}}};
  c.lend_free_memory = true;
  KVCacheManager m(Model(2), c);
  const auto prompt = Iota(13);
  Add(m, 1, prompt);  // window 4 (two blocks of its own) borrows slabs
  EXPECT_EQ(m.GetStats().lent_slabs, 2);
  m.RemoveSequence(1);
  EXPECT_GT(m.GetStats().num_cached_nodes, 0);
  EXPECT_EQ(Reusable(m, prompt), 12);
  EXPECT_TRUE(m.ResetPrefixCache());
  EXPECT_EQ(Reusable(m, prompt), 0);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 0);
  const KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.free_num_blocks, s.max_num_blocks);
  m.CheckInvariants();
  Add(m, 2, prompt);
  m.CheckInvariants();
}

TEST(ResetPrefixCacheTest, WithoutReuseNothingToClear) {
  ManagerConfig c = ResetConfig({}, {{64, 8}});
  c.enable_block_reuse = false;
  KVCacheManager m(Model(1), c);
  EXPECT_TRUE(m.ResetPrefixCache());
  Add(m, 1, Iota(9));
  EXPECT_FALSE(m.ResetPrefixCache());
  m.RemoveSequence(1);
  EXPECT_TRUE(m.ResetPrefixCache());
  EXPECT_EQ(m.GetNumFreeBlocks(64), 8);
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache
