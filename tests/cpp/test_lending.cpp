// Windows that lend each other memory (ManagerConfig::lend_free_memory): exact block ids, slab
// moves, what a lent block loses, all-or-nothing failures and the shared memory layout.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Iota;

constexpr BlockId N = kNullBlock;

// Windows {4, 16} (16 = full attention at max_seq_len 16), 4-token blocks, host memory.
ManagerConfig LendConfig(std::map<WindowSize, std::int32_t> primary, std::vector<std::int32_t> pattern = {4, 0}) {
  ManagerConfig c = testing::Config(std::move(pattern), 16, std::move(primary), 4);
  c.lend_free_memory = true;
  return c;
}

std::map<WindowSize, std::int64_t> Owned(const KVCacheManager& m) { return m.GetStats().num_owned_blocks_per_window_size; }

TEST(LendingTest, WindowOutOfBlocksBorrowsTheNextVictimOfAnother) {
  // Equal block sizes: a slab is one block of each window. Window 4 owns slabs 0-1 (its ids 0,
  // 1), full attention slabs 2-7 (its ids 2..7).
  KVCacheManager m(testing::Model(2), LendConfig({{4, 2}, {16, 6}}));
  EXPECT_EQ(m.blocks_per_window().at(4).primary, 2);
  EXPECT_EQ(m.blocks_per_window().at(16).primary, 6);
  EXPECT_EQ(m.GetNumFreeBlocks(4), 2 + 6);  // its own and every wholly free slab of the other
  auto t = Iota(12);
  m.AddSequence(1, t.data(), t.size());  // 3 blocks per window; window 4 has 2
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (std::vector<BlockId>{0, 1, 2}));   // borrowed slab 2
  EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{3, 4, 5}));  // full's victims after it
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 3}, {16, 5}}));
  EXPECT_EQ(m.GetStats().lent_slabs, 1);
  EXPECT_EQ(m.GetStats().max_num_blocks, 8);
  EXPECT_EQ(m.GetNumFreeBlocks(4), 2);   // nothing of its own; full's slabs 6 and 7
  EXPECT_EQ(m.GetNumFreeBlocks(16), 2);  // 6 and 7
  // Token 13: window 4 releases blocks 0 and 1 (out of window) before both windows take one.
  const SeqId id = 1;
  const TokenId tok = 50;
  m.AddTokens(&id, &tok, 1);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (std::vector<BlockId>{N, N, 2, 0}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{3, 4, 5, 6}));
  EXPECT_EQ(m.GetStats().lent_slabs, 1);  // window 4 had free blocks again: nothing borrowed
  m.CheckInvariants();
  m.RemoveSequence(1);
  m.CheckInvariants();
  EXPECT_EQ(m.GetNumFreeBlocks(4), 3 + 5);
  EXPECT_EQ(m.GetStats().used_num_blocks, 0);
}

TEST(LendingTest, JointShortageFailsWithNothingChanged) {
  KVCacheManager m(testing::Model(2), LendConfig({{4, 2}, {16, 6}}));
  auto a = Iota(12);
  m.AddSequence(1, a.data(), a.size());  // window 4: 0 1 2 (2 borrowed); full: 3 4 5; free: 6 7
  const auto before = testing::Take(m, {1, 2});
  const auto owned = Owned(m);
  // 3 more blocks per window: full can lend nothing it needs itself, window 4 has none.
  EXPECT_FALSE(m.CanAllocate({{4, 3}, {16, 3}}));
  EXPECT_TRUE(m.CanAllocate({{4, 1}, {16, 1}}));   // window 4 borrows 7 while full takes 6
  EXPECT_FALSE(m.CanAllocate({{4, 1}, {16, 2}}));  // full needs both of its free blocks
  EXPECT_TRUE(m.CanAllocate({{4, 2}}));
  auto b = Iota(12, 100);
  EXPECT_THROW(m.AddSequence(2, b.data(), b.size()), OutOfBlocksError);
  try {
    m.AddSequence(2, b.data(), b.size());
  } catch (const OutOfBlocksError& e) {
    EXPECT_NE(std::string(e.what()).find("wholly free slabs could lend"), std::string::npos) << e.what();
  }
  EXPECT_EQ(testing::Take(m, {1, 2}), before);
  EXPECT_EQ(Owned(m), owned);
  EXPECT_EQ(m.GetStats().lent_slabs, 1);
  m.CheckInvariants();
  // One block per window fits: window 4 borrows full's oldest free slab (6), full takes 7.
  auto c = Iota(4, 200);
  m.AddSequence(3, c.data(), c.size());
  EXPECT_EQ(m.GetCacheBlockIds(3, 4), (std::vector<BlockId>{6}));
  EXPECT_EQ(m.GetCacheBlockIds(3, 16), (std::vector<BlockId>{7}));
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 4}, {16, 4}}));
  m.CheckInvariants();
}

TEST(LendingTest, LentCachedBlockLeavesTheTreeAndItsReleaserBecomesInvalid) {
  // Window 5 (not a multiple of the block: a decode step can release and allocate at once):
  // ids 0-2; full attention: ids 3-5.
  ManagerConfig c = LendConfig({{5, 3}, {16, 3}}, {5, 0});
  c.enable_block_reuse = true;
  c.swa_reuse_policy = SwaReusePolicy::kInvalidate;
  KVCacheManager m(testing::Model(2), c);
  auto p = Iota(5);
  m.AddSequence(1, p.data(), p.size());  // window 5: 0 1; full: 3 4
  EXPECT_EQ(m.StoreContextBlocks(1), 1);  // block 0 of window 5 and block 3 of full are cached
  const SeqId id = 1;
  for (const TokenId t : {90, 91, 92, 93, 94, 95, 96}) m.AddTokens(&id, &t, 1);
  // Token 9 released cached block 0 out of window (request 1 keeps a record of it).
  ASSERT_EQ(m.GetCacheBlockIds(1, 5), (std::vector<BlockId>{N, 1, 2}));
  ASSERT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{3, 4, 5}));
  EXPECT_EQ(m.CachedBlockHashes(5).size(), 1u);
  EXPECT_EQ(m.GetNumFreeBlocks(16), 1);  // nothing of its own: window 5's cached block 0
  // Token 13 needs a block in each window. Full has none and first borrows window 5's next
  // victim, cached block 0 (window 5's scratch queue is empty; the block 1 it releases in this
  // step covers its own need); window 5 then releases block 1 and takes it again.
  const TokenId t = 97;
  m.AddTokens(&id, &t, 1);
  EXPECT_EQ(m.GetCacheBlockIds(1, 5), (std::vector<BlockId>{N, N, 2, 1}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{3, 4, 5, 0}));
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{5, 2}, {16, 4}}));
  EXPECT_EQ(m.GetStats().lent_slabs, 1);
  EXPECT_TRUE(m.CachedBlockHashes(5).empty());    // the lent block's content is gone
  EXPECT_EQ(m.CachedBlockHashes(16).size(), 1u);  // full's own cached block stays
  EXPECT_FALSE(m.IsSequenceValidForReuse(1));     // its record of block 0 is stale
  m.CheckInvariants();
}

TEST(LendingTest, BetweenStepsAWindowThatEvictedCacheTakesAnotherWindowsCheaperSlab) {
  ManagerConfig c = LendConfig({{4, 2}, {16, 6}});  // window 4: ids 0, 1; full: ids 2-7
  c.enable_block_reuse = true;
  KVCacheManager m(testing::Model(2), c);
  auto p = Iota(8);
  m.AddSequence(1, p.data(), p.size());  // window 4: 0 1; full: 2 3
  m.RemoveSequence(1);                   // both windows cache 7 tokens (a full and a partial block)
  EXPECT_EQ(m.CachedBlockHashes(4).size(), 2u);
  // Inside a step nothing moves: window 4's free blocks both hold cached content, and it
  // evicts its partial block 1 although full attention has scratch blocks.
  auto q = Iota(4, 100);
  m.AddSequence(2, q.data(), q.size());
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (std::vector<BlockId>{1}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 16), (std::vector<BlockId>{4}));
  EXPECT_EQ(m.CachedBlockHashes(4).size(), 1u);
  EXPECT_EQ(m.GetStats().lent_slabs, 0);
  // Between steps: window 4 evicted one cached block; full's next victim (scratch block 5) is
  // cheaper than window 4's (cached block 0), so slab 5 moves.
  m.RefreshBlocks();
  EXPECT_EQ(m.GetStats().lent_slabs, 1);
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 3}, {16, 5}}));
  m.CheckInvariants();
  m.RefreshBlocks();  // no eviction since: nothing moves
  EXPECT_EQ(m.GetStats().lent_slabs, 1);
  // The next request's window-4 block is the borrowed scratch one: block 0 keeps its prefix.
  auto r = Iota(4, 200);
  m.AddSequence(3, r.data(), r.size());
  EXPECT_EQ(m.GetCacheBlockIds(3, 4), (std::vector<BlockId>{5}));
  EXPECT_EQ(m.GetCacheBlockIds(3, 16), (std::vector<BlockId>{6}));
  EXPECT_EQ(m.CachedBlockHashes(4).size(), 1u);
  EXPECT_EQ(m.GetReusablePrefixLength(p.data(), p.size(), {}), 4);
  m.CheckInvariants();
}

TEST(LendingTest, BetweenStepsEqualPriorityCacheMovesTheSlabQueuedLongestAgo) {
  // Window 4 owns slabs 0-2 (its ids 0..2), full attention slabs 3-4 (its ids 3, 4). Every
  // cached block below has the default priority and no hit: only the time each was queued
  // (the stamp of its eviction key, one clock for both windows) tells the victims apart.
  ManagerConfig c = LendConfig({{4, 3}, {16, 2}});
  c.enable_block_reuse = true;
  KVCacheManager m(testing::Model(2), c);
  auto p = Iota(8);
  m.AddSequence(1, p.data(), p.size());  // window 4: 0 1; full: 3 4
  ASSERT_EQ(m.GetCacheBlockIds(1, 4), (std::vector<BlockId>{0, 1}));
  ASSERT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{3, 4}));
  // Both windows cache 7 tokens; window 4's blocks are queued first (1, then 0), full's after
  // them (4, then 3).
  m.RemoveSequence(1);
  ASSERT_EQ(m.CachedBlockHashes(4).size(), 2u);
  ASSERT_EQ(m.CachedBlockHashes(16).size(), 2u);
  // Window 4 takes its scratch block 2; full has no scratch block and evicts its cached block 4.
  auto q = Iota(4, 100);
  m.AddSequence(2, q.data(), q.size());
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (std::vector<BlockId>{2}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 16), (std::vector<BlockId>{4}));
  EXPECT_EQ(m.CachedBlockHashes(4).size(), 2u);
  EXPECT_EQ(m.CachedBlockHashes(16).size(), 1u);
  EXPECT_EQ(m.GetStats().lent_slabs, 0);
  // Between steps: full evicted one cached block. Its own next victim, block 3, was queued
  // after window 4's next victim, block 1 (same priority), so window 4's slab 1 moves.
  m.RefreshBlocks();
  EXPECT_EQ(m.GetStats().lent_slabs, 1);
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 2}, {16, 3}}));
  EXPECT_EQ(m.CachedBlockHashes(4).size(), 1u);  // the lent block's content is gone
  EXPECT_EQ(m.CachedBlockHashes(16).size(), 1u);
  m.CheckInvariants();
  // The next request's full-attention block is the borrowed one: full keeps block 3's prefix,
  // and window 4 evicts block 0, its oldest left.
  auto r = Iota(4, 200);
  m.AddSequence(3, r.data(), r.size());
  EXPECT_EQ(m.GetCacheBlockIds(3, 4), (std::vector<BlockId>{0}));
  EXPECT_EQ(m.GetCacheBlockIds(3, 16), (std::vector<BlockId>{1}));
  EXPECT_EQ(m.CachedBlockHashes(4).size(), 0u);
  EXPECT_EQ(m.CachedBlockHashes(16).size(), 1u);
  m.CheckInvariants();
}

TEST(LendingTest, BetweenStepsNoSlabMovesWhenTheOtherWindowsVictimIsNewer) {
  // The mirror of the test above: window 4 (ids 0, 1) evicts, full attention (ids 2..4) could
  // lend, but its cached victim was queued after window 4's own: nothing moves.
  ManagerConfig c = LendConfig({{4, 2}, {16, 3}});
  c.enable_block_reuse = true;
  KVCacheManager m(testing::Model(2), c);
  auto p = Iota(8);
  m.AddSequence(1, p.data(), p.size());  // window 4: 0 1; full: 2 3
  m.RemoveSequence(1);                   // queued: window 4's 1, 0, then full's 3, 2
  auto q = Iota(4, 100);
  m.AddSequence(2, q.data(), q.size());  // window 4 evicts block 1; full takes scratch block 4
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (std::vector<BlockId>{1}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 16), (std::vector<BlockId>{4}));
  m.RefreshBlocks();  // full's victim, block 3, is newer than window 4's, block 0
  EXPECT_EQ(m.GetStats().lent_slabs, 0);
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 2}, {16, 3}}));
  EXPECT_EQ(m.CachedBlockHashes(4).size(), 1u);
  EXPECT_EQ(m.CachedBlockHashes(16).size(), 2u);
  m.CheckInvariants();
}

TEST(LendingTest, NothingMovesBetweenStepsUnderInvalidate) {
  ManagerConfig c = LendConfig({{4, 2}, {16, 6}});
  c.enable_block_reuse = true;
  c.swa_reuse_policy = SwaReusePolicy::kInvalidate;
  KVCacheManager m(testing::Model(2), c);
  auto p = Iota(8);
  m.AddSequence(1, p.data(), p.size());
  m.RemoveSequence(1);
  auto q = Iota(4, 100);
  m.AddSequence(2, q.data(), q.size());
  m.RefreshBlocks();
  EXPECT_EQ(m.GetStats().lent_slabs, 0);
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 2}, {16, 6}}));
}

TEST(LendingTest, UnequalBlockSizesMoveWholeSlabs) {
  // Pattern {4, 4, full}: window 4 has two layers, full one, so a slab is one window-4 block or
  // two full blocks. 4 window-4 blocks + 2 full blocks = 5 slabs: window 4 owns slabs 0-3 (its
  // ids 0..3), full slab 4 (its ids 8, 9).
  KVCacheManager m(testing::Model(3), LendConfig({{4, 4}, {16, 2}}, {4, 4, 0}));
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 4}, {16, 2}}));
  const std::vector<PoolInfo> pools = m.pools();
  ASSERT_EQ(pools.size(), 2u);
  EXPECT_EQ(pools[0].primary_ptr, pools[1].primary_ptr);  // one arena
  EXPECT_EQ(pools[0].block_stride, 2 * pools[1].block_stride);
  EXPECT_EQ(pools[0].block_stride, pools[0].block_bytes);
  EXPECT_EQ(pools[0].num_primary, 5);  // ids span the arena
  EXPECT_EQ(pools[1].num_primary, 10);
  EXPECT_EQ(m.GetNumFreeBlocks(16), 2 + 4 * 2);
  auto t = Iota(16);
  m.AddSequence(1, t.data(), t.size(), {}, /*prefill=*/8);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{8, 9}));
  // Next chunk: full has nothing free and first borrows window 4's next victim, slab 2 (full
  // blocks 4 and 5); then window 4 releases block 0 and takes 3.
  m.Prefill(1, 4);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (std::vector<BlockId>{N, 1, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{8, 9, 4}));
  EXPECT_EQ(Owned(m), (std::map<WindowSize, std::int64_t>{{4, 3}, {16, 4}}));
  m.Prefill(1, 4);  // full uses the other half of the slab; window 4 reuses block 0
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (std::vector<BlockId>{N, N, 3, 0}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{8, 9, 4, 5}));
  EXPECT_EQ(m.GetStats().lent_slabs, 1);
  EXPECT_EQ(m.GetNumFreeBlocks(4), 1);   // block 1; full has no wholly free slab
  EXPECT_EQ(m.GetNumFreeBlocks(16), 2);  // window 4's slab 1
  m.CheckInvariants();
  m.RemoveSequence(1);
  m.CheckInvariants();
  EXPECT_EQ(m.GetNumFreeBlocks(16), 4 + 3 * 2);
}

TEST(LendingTest, ViewsAndOffsetsAddressTheSharedArena) {
  KVCacheManager m(testing::Model(3), LendConfig({{4, 2}, {16, 4}}, {4, 4, 0}));
  auto t = Iota(16);
  m.AddSequence(1, t.data(), t.size(), {}, 4);
  // Layer 2 (full attention) writes its block; the bytes sit in the arena at the full stride.
  const LayerView full = m.GetLayerView(2);
  const LayerView swa = m.GetLayerView(1);  // second layer of window 4's pool
  EXPECT_EQ(full.shape[0], 8);
  EXPECT_EQ(swa.shape[0], 4);
  EXPECT_EQ(swa.strides[0], 2 * full.strides[0]);
  EXPECT_EQ(static_cast<unsigned char*>(swa.data) - static_cast<unsigned char*>(m.GetLayerView(0).data),
            full.strides[0]);  // layer 1 follows layer 0 inside a window-4 block
  const std::vector<PoolInfo> pools = m.pools();
  // Full block b and window-4 block b / 2 share bytes: full block 5 is the second half of
  // window-4 block 2.
  auto* base = reinterpret_cast<unsigned char*>(pools[0].primary_ptr);
  EXPECT_EQ(static_cast<unsigned char*>(full.data) + 5 * full.strides[0], base + 2 * swa.strides[0] + full.strides[0]);
  // Offsets count K/V slabs from the pool base: block * stride / slab + k.
  std::vector<std::int32_t> out(2 * 1 * 2 * 4, -7);
  const SeqId id = 1;
  EXPECT_EQ(m.CopyBlockOffsets(out.data(), 1, 4, &id, 1, 0), 1);
  const std::int32_t swa_slabs_per_block = 4;   // 2 layers x K, V
  const std::int32_t full_slabs_per_block = 2;  // 1 layer x K, V
  const BlockId b4 = m.GetCacheBlockIds(1, 4)[0];
  const BlockId bf = m.GetCacheBlockIds(1, 16)[0];
  EXPECT_EQ(out[0], b4 * swa_slabs_per_block);
  EXPECT_EQ(out[4], b4 * swa_slabs_per_block + 1);
  EXPECT_EQ(out[8], bf * full_slabs_per_block);
  EXPECT_EQ(out[12], bf * full_slabs_per_block + 1);
}

TEST(LendingTest, RejectsGeometryItCannotShare) {
  ModelSpec model = testing::Model(2, {1}, 8);
  model.num_kv_heads = {1021, 1031};  // coprime head counts: a slab would be 1021 x 1031 blocks
  EXPECT_THROW(KVCacheManager(model, LendConfig({{4, 2000}, {16, 2000}})), std::invalid_argument);
  // Fewer slabs than windows.
  ModelSpec two = testing::Model(3);
  EXPECT_THROW(KVCacheManager(two, LendConfig({{4, 1}, {16, 1}}, {4, 4, 0})), std::invalid_argument);
  // A single window lends nothing: the flag is accepted and ignored.
  KVCacheManager single(testing::Model(1), LendConfig({{16, 3}}, {0}));
  EXPECT_FALSE(single.lends_free_memory());
  EXPECT_EQ(single.pools()[0].block_stride, single.pools()[0].block_bytes);
}

}  // namespace
}  // namespace kvcache
