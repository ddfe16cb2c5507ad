// The disk tier below host memory: evicted host blocks are written to disk, onboarded on a
// hit with their bytes intact, evicted LRU when the tier is full; events name level 2.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

ManagerConfig DiskConfig(std::int32_t primary, std::int32_t secondary, std::int32_t disk,
                         BackendKind backend = BackendKind::kHost) {
  ManagerConfig c = Config({}, 64, {{64, primary}}, /*tpb=*/4, backend);
  c.blocks_per_window[64].secondary = secondary;
  c.disk_blocks_per_window[64] = disk;
  c.enable_block_reuse = true;
  c.event_buffer_max_size = 1000;
  return c;
}

std::int32_t Add(KVCacheManager& m, SeqId id, const std::vector<TokenId>& tokens) {
  return m.AddSequence(id, tokens.data(), tokens.size(), {});
}

/// The bytes of block `b` in every layer (each layer's K and V of that block).
std::vector<unsigned char> BlockBytes(KVCacheManager& m, BlockId b, std::int32_t layers) {
  std::vector<unsigned char> out;
  for (std::int32_t l = 0; l < layers; ++l) {
    const LayerView v = m.GetLayerView(l);
    const auto* base = static_cast<const unsigned char*>(v.data) + b * v.strides[0];
    const auto bytes = static_cast<std::size_t>(v.strides[1] * v.shape[1]);
    out.insert(out.end(), base, base + bytes);
  }
  return out;
}

void Fill(KVCacheManager& m, BlockId b, std::int32_t layers, std::mt19937* rng) {
  for (std::int32_t l = 0; l < layers; ++l) {
    const LayerView v = m.GetLayerView(l);
    auto* base = static_cast<unsigned char*>(v.data) + b * v.strides[0];
    for (std::int64_t i = 0; i < v.strides[1] * v.shape[1]; ++i) base[i] = static_cast<unsigned char>((*rng)());
  }
}

std::vector<std::pair<int, int>> LevelMoves(KVCacheManager& m) {
  std::vector<std::pair<int, int>> out;
  for (const KVCacheEvent& e : m.GetLatestEvents(0)) {
    if (e.kind == EventKind::kUpdated && e.cache_level.has_value()) out.push_back(*e.cache_level);
  }
  return out;
}

TEST(DiskTierTest, HostBlocksGoToDiskAndComeBackByteForByte) {
  constexpr std::int32_t kLayers = 2;
  KVCacheManager m(Model(kLayers, {2}, 8), DiskConfig(/*primary=*/3, /*secondary=*/1, /*disk=*/4));
  std::mt19937 rng(1);
  const auto a = Iota(9);
  Add(m, 1, a);  // blocks 0, 1, 2
  Fill(m, 0, kLayers, &rng);
  Fill(m, 1, kLayers, &rng);
  const auto a0 = BlockBytes(m, 0, kLayers);
  const auto a1 = BlockBytes(m, 1, kLayers);
  m.RemoveSequence(1);  // caches a0 (block 0) and a1 (block 1)
  m.GetLatestEvents(0);
  // B takes block 2 (scratch), then block 1 (a1 goes to host block 3), then block 0: a0 goes
  // to the host block, so a1 moves on to disk first.
  Add(m, 2, Iota(9, 100));
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{2, 1, 0}));
  EXPECT_EQ(LevelMoves(m), (std::vector<std::pair<int, int>>{{0, 1}, {1, 2}, {0, 1}}));
  for (BlockId b = 0; b < 3; ++b) Fill(m, b, kLayers, &rng);  // B overwrites every block
  m.RemoveSequence(2, /*store_for_reuse=*/false);
  m.CheckInvariants();
  // A again: a0 is onboarded from host memory, a1 from disk, bytes intact.
  EXPECT_EQ(m.GetReusablePrefixLength(a.data(), a.size(), {}), 8);
  EXPECT_EQ(Add(m, 3, a), 8);
  EXPECT_EQ(LevelMoves(m), (std::vector<std::pair<int, int>>{{1, 0}, {2, 0}}));
  const auto got = m.GetCacheBlockIds(3, 64);
  EXPECT_EQ(BlockBytes(m, got[0], kLayers), a0);
  EXPECT_EQ(BlockBytes(m, got[1], kLayers), a1);
  EXPECT_EQ(m.GetStats().onboarded_blocks, 2);
  EXPECT_EQ(m.GetStats().offloaded_blocks, 2);
  m.CheckInvariants();
}

TEST(DiskTierTest, FullDiskDropsItsLeastRecentlyUsedBlock) {
  KVCacheManager m(Model(1), DiskConfig(/*primary=*/3, /*secondary=*/1, /*disk=*/1));
  // Four 1-block prompts (5 tokens: 1 cached block + 1 scratch block each). The third and the
  // fourth push the oldest ones down: prompt 0 to host memory, then on to disk for prompt 1.
  for (SeqId r = 0; r < 4; ++r) {
    Add(m, r, Iota(5, 100 * static_cast<TokenId>(r)));
    m.RemoveSequence(r);
  }
  std::vector<std::int32_t> reusable;
  for (TokenId r = 0; r < 4; ++r) {
    const auto t = Iota(5, 100 * r);
    reusable.push_back(m.GetReusablePrefixLength(t.data(), t.size(), {}));
  }
  EXPECT_EQ(reusable, (std::vector<std::int32_t>{4, 4, 4, 4}));  // GPU: 2, 3; host: 1; disk: 0
  // New content takes every primary block: prompts 2 and 3 move down, and each one that
  // reaches the full disk drops the least recently used block there (0, then 1).
  Add(m, 10, Iota(9, 1000));
  m.RemoveSequence(10, /*store_for_reuse=*/false);
  reusable.clear();
  for (TokenId r = 0; r < 4; ++r) {
    const auto t = Iota(5, 100 * r);
    reusable.push_back(m.GetReusablePrefixLength(t.data(), t.size(), {}));
  }
  EXPECT_EQ(reusable, (std::vector<std::int32_t>{0, 0, 4, 4}));  // host: 3; disk: 2
  m.CheckInvariants();
}

TEST(DiskTierTest, PartialReuseCopiesFromADiskBlock) {
  constexpr std::int32_t kLayers = 1;
  KVCacheManager m(Model(kLayers, {1}, 8), DiskConfig(/*primary=*/3, /*secondary=*/1, /*disk=*/2));
  std::mt19937 rng(7);
  const auto a = Iota(9);
  Add(m, 1, a);
  Fill(m, 1, kLayers, &rng);
  const auto a1 = BlockBytes(m, 1, kLayers);
  m.RemoveSequence(1);
  Add(m, 2, Iota(9, 100));  // a1 ends on disk, a0 in host memory (as above)
  m.RemoveSequence(2, /*store_for_reuse=*/false);
  // Tokens 0..5 then others: block 0 whole (onboard), block 1's first 2 tokens copied from disk.
  std::vector<TokenId> b = Iota(6);
  b.push_back(500);
  b.push_back(501);
  b.push_back(502);
  EXPECT_EQ(Add(m, 3, b), 6);
  const auto got = m.GetCacheBlockIds(3, 64);
  const auto have = BlockBytes(m, got[1], kLayers);
  // Layer view of one block: [kv, heads, tokens, head_dim] float16: 2 tokens = 32 bytes per row.
  const LayerView v = m.GetLayerView(0);
  const auto token_bytes = static_cast<std::size_t>(v.strides[3]);
  const auto row = static_cast<std::size_t>(v.strides[1]);  // K to V
  for (std::size_t k = 0; k < 2; ++k) {  // K and V (one head)
    for (std::size_t i = 0; i < 2 * token_bytes; ++i) EXPECT_EQ(have[k * row + i], a1[k * row + i]);
  }
  m.CheckInvariants();
}

TEST(DiskTierTest, VirtualBackendKeepsTheBookkeeping) {
  KVCacheManager m(Model(1), DiskConfig(3, 1, 2, BackendKind::kVirtual));
  Add(m, 1, Iota(9));
  m.RemoveSequence(1);
  Add(m, 2, Iota(9, 100));
  m.RemoveSequence(2, false);
  EXPECT_EQ(Add(m, 3, Iota(9)), 8);
  EXPECT_EQ(m.GetStats().onboarded_blocks, 2);
  m.CheckInvariants();
}

TEST(DiskTierTest, BadCountsAreRefused) {
  ManagerConfig c = DiskConfig(3, 0, 2);
  EXPECT_THROW(KVCacheManager(Model(1), c), std::invalid_argument);  // no host pool
  c = DiskConfig(3, 1, -1);
  EXPECT_THROW(KVCacheManager(Model(1), c), std::invalid_argument);
  c = DiskConfig(3, 1, 1);
  c.disk_blocks_per_window[32] = 1;
  EXPECT_THROW(KVCacheManager(Model(1), c), std::invalid_argument);  // not a window
}

}  // namespace
}  // namespace kvcache
