#include "kvcache/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kvcache/errors.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Add;
using testing::Config;
using testing::Iota;
using testing::Model;
using testing::Take;
constexpr BlockId N = kNullBlock;

TEST(KVCacheManagerTest, GroupsLayersByWindow) {
  KVCacheManager m(Model(6), Config({8, 16, 0}, 64, {{8, 4}, {16, 4}, {64, 4}}));
  EXPECT_EQ(m.window_sizes(), (std::vector<WindowSize>{8, 16, 64}));
  ASSERT_EQ(m.pools().size(), 3u);
  EXPECT_EQ(m.pools()[0].layers, (std::vector<std::int32_t>{0, 3}));
  EXPECT_EQ(m.pools()[1].layers, (std::vector<std::int32_t>{1, 4}));
  EXPECT_EQ(m.pools()[2].layers, (std::vector<std::int32_t>{2, 5}));
  EXPECT_EQ(m.max_blocks_per_seq(), 16);
  // A window >= max_seq_len is full attention; an empty pattern is all full attention.
  KVCacheManager full(Model(2), Config({128, 0}, 64, {{64, 4}}));
  EXPECT_EQ(full.window_sizes(), (std::vector<WindowSize>{64}));
  KVCacheManager none(Model(2), Config({}, 64, {{64, 4}}));
  EXPECT_EQ(none.window_sizes(), (std::vector<WindowSize>{64}));
}

TEST(KVCacheManagerTest, MayCopyBlocksOnlyWithMemoryAndATierOrPartialCopies) {
  // Two windows (8 and full 16), 4-token blocks, 8 primary blocks each.
  auto config = [](BackendKind backend) { return Config({8, 16}, 16, {{8, 8}, {16, 8}}, 4, backend); };
  EXPECT_FALSE(KVCacheManager(Model(2), config(BackendKind::kHost)).MayCopyBlocks());  // no tier, no reuse
  ManagerConfig secondary = config(BackendKind::kHost);
  secondary.blocks_per_window[16].secondary = 2;  // one window's host tier is enough (a disk tier needs one)
  EXPECT_TRUE(KVCacheManager(Model(2), secondary).MayCopyBlocks());
  ManagerConfig partial = config(BackendKind::kHost);
  partial.enable_block_reuse = true;  // partial reuse and copy on partial reuse are on by default
  EXPECT_TRUE(KVCacheManager(Model(2), partial).MayCopyBlocks());
  partial.copy_on_partial_reuse = false;  // a partly matched block is only ever taken over
  EXPECT_FALSE(KVCacheManager(Model(2), partial).MayCopyBlocks());
  partial.copy_on_partial_reuse = true;
  partial.enable_partial_reuse = false;
  EXPECT_FALSE(KVCacheManager(Model(2), partial).MayCopyBlocks());
  // The virtual backend has no bytes to copy, tiers or not.
  ManagerConfig virt = secondary;
  virt.backend = BackendKind::kVirtual;
  virt.enable_block_reuse = true;
  EXPECT_FALSE(KVCacheManager(Model(2), virt).MayCopyBlocks());
}

TEST(KVCacheManagerTest, RejectsBadConstruction) {
  EXPECT_THROW(KVCacheManager(Model(2), Config({8, 0}, 64, {{8, 4}})), std::invalid_argument);
  EXPECT_THROW(KVCacheManager(Model(2), Config({8, 0}, 64, {{8, 4}, {64, 0}})), std::invalid_argument);
  EXPECT_THROW(KVCacheManager(Model(2), Config({8, 0}, 0, {{8, 4}, {64, 4}})), std::invalid_argument);
  EXPECT_THROW(KVCacheManager(Model(3, {1, 2}), Config({}, 64, {{64, 4}})), std::invalid_argument);
  EXPECT_THROW(KVCacheManager(Model(2), Config({}, 64, {{64, 4}}, 0)), std::invalid_argument);
  for (const double fraction : {-0.1, 1.5, std::nan("")}) {
    ManagerConfig c = Config({}, 64, {{64, 4}});
    c.protected_fraction = fraction;
    EXPECT_THROW(KVCacheManager(Model(2), c), std::invalid_argument) << fraction;
  }
}

// Window 3 with 4-token blocks: allocation and release token by token.
TEST(KVCacheManagerTest, WindowSmallerThanBlock) {
  KVCacheManager m(Model(1), Config({3}, 32, {{3, 4}}));
  Add(m, 7, 1);
  struct Step {
    std::int32_t n;
    std::vector<BlockId> blocks;
    std::int32_t free;
  };
  const std::vector<Step> expected = {
      {1, {0}, 3},           {2, {0}, 3},           {3, {0}, 3},
      {4, {0}, 3},           {5, {0, 1}, 2},        {6, {0, 1}, 2},
      {7, {N, 1}, 3},        {8, {N, 1}, 3},        {9, {N, 1, 2}, 2},
      {10, {N, 1, 2}, 2},    {11, {N, N, 2}, 3},    {12, {N, N, 2}, 3},
      {13, {N, N, 2, 3}, 2}, {14, {N, N, 2, 3}, 2}, {15, {N, N, N, 3}, 3},
      {16, {N, N, N, 3}, 3}, {17, {N, N, N, 3, 0}, 2},
  };
  for (const Step& s : expected) {
    if (s.n > 1) m.AddToken(7, s.n);
    ASSERT_EQ(m.NumTokens(7), s.n);
    EXPECT_EQ(m.GetCacheBlockIds(7, 3), s.blocks) << "after " << s.n << " tokens";
    EXPECT_EQ(m.GetNumFreeBlocks(3), s.free) << "after " << s.n << " tokens";
    m.CheckInvariants();
  }
  m.RemoveSequence(7);
  EXPECT_EQ(m.GetNumFreeBlocks(3), 4);
  EXPECT_FALSE(m.HasSequence(7));
  m.CheckInvariants();
}

// Windows {8, 16, full} with 3 layers: exact lists after each of 40 appended tokens.
TEST(KVCacheManagerTest, ThreeWindowsSlideIndependently) {
  const std::map<WindowSize, std::int32_t> pool = {{8, 4}, {16, 6}, {64, 16}};
  KVCacheManager m(Model(3), Config({8, 16, 0}, 64, pool));
  Add(m, 1, 1);
  for (std::int32_t n = 2; n <= 41; ++n) {
    m.AddToken(1, 1000 + n);
    m.CheckInvariants();
    const std::int32_t positions = (n + 3) / 4;
    for (const auto& [w, blocks] : pool) {
      // Positions whose every token is below n - w are released; with one sequence and FIFO
      // free queues the block of position j is j % (pool size).
      const std::int32_t released = w == 64 ? 0 : std::max(0, (n - w) / 4);
      std::vector<BlockId> want;
      for (std::int32_t j = 0; j < positions; ++j) want.push_back(j < released ? N : j % blocks);
      ASSERT_EQ(m.GetCacheBlockIds(1, w), want) << "window " << w << " after " << n << " tokens";
      EXPECT_EQ(m.GetNumFreeBlocks(w), blocks - (positions - released)) << "window " << w;
    }
    if (n == 21) {
      EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, N, N, 3, 0, 1}));
      EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{N, 1, 2, 3, 4, 5}));
      EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1, 2, 3, 4, 5}));
    }
  }
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, N, N, N, N, N, N, N, 0, 1, 2}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 16), (std::vector<BlockId>{N, N, N, N, N, N, 0, 1, 2, 3, 4}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(m.GetNumFreeBlocks(8), 1);
  EXPECT_EQ(m.GetNumFreeBlocks(16), 1);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 5);
  EXPECT_EQ(m.GetMinNumFreeBlocks(), 1);
  m.RemoveSequence(1);
  for (const auto& [w, blocks] : pool) EXPECT_EQ(m.GetNumFreeBlocks(w), blocks);
  m.CheckInvariants();
}

// A long prompt keeps all its blocks until the first generated token, which releases several.
TEST(KVCacheManagerTest, FirstTokenAfterLongPromptReleasesSeveralBlocks) {
  KVCacheManager m(Model(2), Config({8, 0}, 64, {{8, 8}, {64, 8}}));
  Add(m, 1, 20);
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{0, 1, 2, 3, 4}));
  m.AddToken(1, 5);  // 21 tokens: positions below 13 are out of the window
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, N, N, 3, 4, 5}));
  EXPECT_EQ(m.GetNumFreeBlocks(8), 5);
  m.CheckInvariants();
}

TEST(KVCacheManagerTest, PerLayerHeadsGiveSeveralPools) {
  KVCacheManager m(Model(4, {4, 2, 4, 1}), Config({}, 32, {{32, 5}}));
  const auto pools = m.pools();
  ASSERT_EQ(pools.size(), 3u);
  EXPECT_EQ(pools[0].num_kv_heads, 1);
  EXPECT_EQ(pools[0].layers, (std::vector<std::int32_t>{3}));
  EXPECT_EQ(pools[0].block_bytes, 1u * 2 * 1 * 4 * 8 * 2);
  EXPECT_EQ(pools[1].num_kv_heads, 2);
  EXPECT_EQ(pools[1].layers, (std::vector<std::int32_t>{1}));
  EXPECT_EQ(pools[1].block_bytes, 1u * 2 * 2 * 4 * 8 * 2);
  EXPECT_EQ(pools[2].num_kv_heads, 4);
  EXPECT_EQ(pools[2].layers, (std::vector<std::int32_t>{0, 2}));
  EXPECT_EQ(pools[2].block_bytes, 2u * 2 * 4 * 4 * 8 * 2);
  using P = std::pair<std::int32_t, std::int32_t>;
  EXPECT_EQ(m.layer_to_pool(), (std::vector<P>{{2, 0}, {1, 0}, {2, 1}, {0, 0}}));
  EXPECT_EQ(m.GetStats().allocated_bytes, 5 * (128 + 256 + 1024));

  const LayerView v = m.GetLayerView(2);
  EXPECT_EQ(v.data, static_cast<void*>(reinterpret_cast<unsigned char*>(pools[2].primary_ptr) + 512));
  EXPECT_EQ(v.shape, (std::array<std::int64_t, 5>{5, 2, 4, 4, 8}));
  EXPECT_EQ(v.strides, (std::array<std::int64_t, 5>{1024, 256, 64, 16, 2}));

  Add(m, 10, 9);  // 3 blocks: 0 1 2
  Add(m, 11, 2);  // 1 block: 3
  const std::int64_t rows = 3;
  const std::int64_t width = 4;
  std::vector<std::int32_t> out(3 * rows * 2 * width, 77);
  const SeqId ids[] = {11, 10};
  EXPECT_EQ(m.CopyBlockOffsets(out.data(), rows, width, ids, 2, /*slot_offset=*/1), 3);
  auto at = [&](int pool, int row, int kv, int j) { return out[((pool * rows + row) * 2 + kv) * width + j]; };
  const std::int32_t S = kOffsetSentinel;
  for (int pool = 0; pool < 3; ++pool) {
    const int stride = pool == 2 ? 4 : 2;  // layers_in_pool * kv_factor
    EXPECT_EQ(at(pool, 0, 0, 0), 77) << "row 0 is not ours";
    EXPECT_EQ(at(pool, 1, 0, 0), 3 * stride);
    EXPECT_EQ(at(pool, 1, 1, 0), 3 * stride + 1);
    EXPECT_EQ(at(pool, 1, 0, 1), S);
    EXPECT_EQ(at(pool, 1, 1, 2), S);
    EXPECT_EQ(at(pool, 1, 0, 3), 77) << "past the widest row is untouched";
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(at(pool, 2, 0, j), j * stride);
      EXPECT_EQ(at(pool, 2, 1, j), j * stride + 1);
    }
  }
  EXPECT_THROW(m.CopyBlockOffsets(out.data(), rows, 2, ids, 2, 0), std::invalid_argument);
  EXPECT_THROW(m.CopyBlockOffsets(out.data(), rows, width, ids, 2, 2), std::invalid_argument);
}

// Layers that differ in head size and dtype, interleaved over the windows: one pool per
// (window, heads, head size, dtype), ordered by heads, then head size, then dtype.
TEST(KVCacheManagerTest, PerLayerHeadSizeAndDtypeGiveSeveralPools) {
  ModelSpec model = Model(6, {1, 2, 1, 2, 1, 2});
  model.head_dims = {4, 8, 8, 8, 4, 8};
  const DType bf = DType::kBFloat16;
  model.dtypes = {bf, DType::kFp8, bf, DType::kFp8, bf, DType::kFloat16};
  KVCacheManager m(model, Config({8, 0}, 32, {{8, 3}, {32, 5}}));
  const auto pools = m.pools();
  ASSERT_EQ(pools.size(), 4u);
  using V = std::vector<std::int32_t>;
  EXPECT_EQ(pools[0].window, 8);
  EXPECT_EQ(pools[0].layers, (V{0, 4}));
  EXPECT_EQ(pools[0].head_dim, 4);
  EXPECT_EQ(pools[0].dtype, bf);
  EXPECT_EQ(pools[0].block_bytes, 2u * 2 * 1 * 4 * 4 * 2);
  EXPECT_EQ(pools[1].layers, (V{2}));
  EXPECT_EQ(pools[1].head_dim, 8);
  EXPECT_EQ(pools[1].block_bytes, 1u * 2 * 1 * 4 * 8 * 2);
  EXPECT_EQ(pools[2].window, 32);
  EXPECT_EQ(pools[2].layers, (V{5}));
  EXPECT_EQ(pools[2].dtype, DType::kFloat16);
  EXPECT_EQ(pools[2].block_bytes, 1u * 2 * 2 * 4 * 8 * 2);
  EXPECT_EQ(pools[3].layers, (V{1, 3}));
  EXPECT_EQ(pools[3].num_kv_heads, 2);
  EXPECT_EQ(pools[3].dtype, DType::kFp8);
  EXPECT_EQ(pools[3].block_bytes, 2u * 2 * 2 * 4 * 8 * 1);
  using P = std::pair<std::int32_t, std::int32_t>;
  EXPECT_EQ(m.layer_to_pool(), (std::vector<P>{{0, 0}, {3, 0}, {1, 0}, {3, 1}, {0, 1}, {2, 0}}));
  EXPECT_EQ(m.GetStats().allocated_bytes, 3 * (128 + 128) + 5 * (256 + 256));

  const LayerView fp8 = m.GetLayerView(3);
  EXPECT_EQ(fp8.dtype, DType::kFp8);
  EXPECT_EQ(fp8.data, static_cast<void*>(reinterpret_cast<unsigned char*>(pools[3].primary_ptr) + 128));
  EXPECT_EQ(fp8.shape, (std::array<std::int64_t, 5>{5, 2, 2, 4, 8}));
  EXPECT_EQ(fp8.strides, (std::array<std::int64_t, 5>{256, 64, 32, 8, 1}));
  const LayerView small = m.GetLayerView(4);
  EXPECT_EQ(small.dtype, bf);
  EXPECT_EQ(small.data, static_cast<void*>(reinterpret_cast<unsigned char*>(pools[0].primary_ptr) + 64));
  EXPECT_EQ(small.shape, (std::array<std::int64_t, 5>{3, 2, 1, 4, 4}));
  EXPECT_EQ(small.strides, (std::array<std::int64_t, 5>{128, 32, 32, 8, 2}));

  Add(m, 1, 6);  // 2 blocks in each window: 0 1
  std::vector<std::int32_t> out(4 * 1 * 2 * 2, 0);
  const SeqId id = 1;
  EXPECT_EQ(m.CopyBlockOffsets(out.data(), 1, 2, &id, 1, 0), 2);
  // block * layers_in_pool * kv_factor + k, per pool: strides 4, 2, 2, 4.
  EXPECT_EQ(out, (V{0, 4, 1, 5, 0, 2, 1, 3, 0, 2, 1, 3, 0, 4, 1, 5}));
  m.CheckInvariants();
}

TEST(KVCacheManagerTest, PerLayerShapeListsMustCoverEveryLayer) {
  ModelSpec model = Model(2);
  model.head_dims = {8};
  EXPECT_THROW(KVCacheManager(model, Config({}, 32, {{32, 4}})), std::invalid_argument);
  model.head_dims = {8, 0};
  EXPECT_THROW(KVCacheManager(model, Config({}, 32, {{32, 4}})), std::invalid_argument);
  model.head_dims = {};
  model.dtypes = {DType::kFp8};
  EXPECT_THROW(KVCacheManager(model, Config({}, 32, {{32, 4}})), std::invalid_argument);
}

TEST(KVCacheManagerTest, OffsetTableShowsReleasedPositionsAsSentinel) {
  KVCacheManager m(Model(2), Config({4, 0}, 32, {{4, 4}, {32, 8}}));
  Add(m, 1, 12);
  m.AddToken(1, 0);  // 13 tokens: window 4 releases positions 0 and 1
  std::vector<std::int32_t> out(2 * 1 * 2 * 4, 0);
  const SeqId id = 1;
  EXPECT_EQ(m.CopyBlockOffsets(out.data(), 1, 4, &id, 1, 0), 4);
  EXPECT_EQ(std::vector<std::int32_t>(out.begin(), out.begin() + 4), (std::vector<std::int32_t>{-1, -1, 4, 6}));
  EXPECT_EQ(std::vector<std::int32_t>(out.begin() + 8, out.begin() + 12), (std::vector<std::int32_t>{0, 2, 4, 6}));
}

TEST(KVCacheManagerTest, ExhaustionChangesNothing) {
  KVCacheManager m(Model(2), Config({8, 0}, 64, {{8, 6}, {64, 6}}));
  Add(m, 1, 4);
  Add(m, 2, 4);
  Add(m, 3, 12);
  const std::vector<SeqId> all = {1, 2, 3, 4};
  auto before = Take(m, all);
  auto prompt = Iota(5);
  EXPECT_THROW(m.AddSequence(4, prompt.data(), prompt.size()), OutOfBlocksError);
  EXPECT_FALSE(m.HasSequence(4));
  EXPECT_EQ(Take(m, all), before);
  m.CheckInvariants();

  // Both sequences cross a block boundary: two blocks per window needed, one free.
  const SeqId ids[] = {1, 2};
  const TokenId toks[] = {50, 51};
  EXPECT_THROW(m.AddTokens(ids, toks, 2), OutOfBlocksError);
  EXPECT_EQ(Take(m, all), before);
  m.CheckInvariants();
  m.AddTokens(ids, toks, 1);
  EXPECT_EQ(m.NumTokens(1), 5);
  EXPECT_EQ(m.GetNumFreeBlocks(8), 0);
  m.CheckInvariants();
}

TEST(KVCacheManagerTest, BlocksReleasedInTheSameStepCanBeReused) {
  KVCacheManager m(Model(1), Config({8}, 64, {{8, 3}}));
  Add(m, 1, 12);
  EXPECT_EQ(m.GetNumFreeBlocks(8), 0);
  m.AddToken(1, 12);  // needs a block and releases position 0 in the same step
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, 1, 2, 0}));
  m.CheckInvariants();
}

TEST(KVCacheManagerTest, ErrorsLeaveStateUnchanged) {
  KVCacheManager m(Model(2), Config({8, 0}, 16, {{8, 8}, {16, 8}}));
  Add(m, 1, 5);
  const std::vector<SeqId> all = {1, 2};
  const auto before = Take(m, all);
  auto ok = Iota(3);
  auto too_long = Iota(17);
  std::vector<TokenId> negative = {1, -2};
  EXPECT_THROW(m.AddSequence(1, ok.data(), ok.size()), std::invalid_argument);  // duplicate
  EXPECT_THROW(m.AddSequence(2, ok.data(), 0), std::invalid_argument);          // empty
  EXPECT_THROW(m.AddSequence(2, too_long.data(), too_long.size()), std::invalid_argument);
  EXPECT_THROW(m.AddSequence(2, negative.data(), negative.size()), std::invalid_argument);
  SequenceOptions bad_priority;
  bad_priority.priority = 101;
  EXPECT_THROW(m.AddSequence(2, ok.data(), ok.size(), bad_priority), std::invalid_argument);
  EXPECT_THROW(m.AddToken(9, 1), UnknownSequenceError);
  EXPECT_THROW(m.AddToken(1, -1), std::invalid_argument);
  EXPECT_THROW(m.RemoveSequence(9), UnknownSequenceError);
  EXPECT_THROW(m.NumTokens(9), UnknownSequenceError);
  EXPECT_THROW(m.Rewind(9, 1), UnknownSequenceError);
  EXPECT_THROW(m.Rewind(1, 5), std::invalid_argument);
  EXPECT_THROW(m.Rewind(1, -1), std::invalid_argument);
  EXPECT_THROW(m.GetCacheBlockIds(9, 8), UnknownSequenceError);
  EXPECT_THROW(m.GetCacheBlockIds(1, 12), std::invalid_argument);
  EXPECT_THROW(m.GetNumFreeBlocks(12), std::invalid_argument);
  EXPECT_THROW(m.GetLayerView(2), std::invalid_argument);
  const SeqId dup[] = {1, 1};
  const TokenId toks[] = {3, 4};
  EXPECT_THROW(m.AddTokens(dup, toks, 2), std::invalid_argument);
  const SeqId unknown_last[] = {1, 9};
  EXPECT_THROW(m.AddTokens(unknown_last, toks, 2), UnknownSequenceError);
  EXPECT_EQ(Take(m, all), before);
  m.CheckInvariants();
  for (int i = 0; i < 11; ++i) m.AddToken(1, i);
  EXPECT_EQ(m.NumTokens(1), 16);
  EXPECT_THROW(m.AddToken(1, 0), std::invalid_argument);  // past max_seq_len
  m.CheckInvariants();
}

TEST(KVCacheManagerTest, RewindReleasesEmptyTailBlocks) {
  KVCacheManager m(Model(2), Config({8, 0}, 64, {{8, 8}, {64, 8}}));
  Add(m, 1, 9);  // 3 blocks per window
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1, 2}));
  m.Rewind(1, 1);  // 8 tokens: position 2 is empty again
  EXPECT_EQ(m.NumTokens(1), 8);
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(m.GetNumFreeBlocks(64), 6);
  m.AddToken(1, 8);  // the rewound block went to the front of the free queue
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1, 2}));
  m.CheckInvariants();
  for (int i = 0; i < 4; ++i) m.AddToken(1, i);  // 13 tokens: window 8 released position 0
  EXPECT_EQ(m.GetCacheBlockIds(1, 8).front(), N);
  // Going back to 11 tokens would need position 0 (tokens >= 3) again: refused, unchanged.
  EXPECT_THROW(m.Rewind(1, 2), std::invalid_argument);
  EXPECT_EQ(m.NumTokens(1), 13);
  m.Rewind(1, 1);  // 12 tokens: positions >= 4 suffice
  EXPECT_EQ(m.NumTokens(1), 12);
  m.CheckInvariants();
}

TEST(KVCacheManagerTest, DraftSlackKeepsBlocksForRewind) {
  ManagerConfig c = Config({8, 0}, 64, {{8, 8}, {64, 8}});
  c.max_draft_tokens = 3;
  KVCacheManager m(Model(2), c);
  Add(m, 1, 12);
  for (int i = 0; i < 3; ++i) m.AddToken(1, i);  // 15 tokens: 15 - 8 - 3 = 4 -> position 0 released
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, 1, 2, 3}));
  m.Rewind(1, 3);  // back to 12 tokens: the window needs tokens >= 4, all still attached
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, 1, 2}));
  m.CheckInvariants();
}

TEST(KVCacheManagerTest, StatsCountAllocations) {
  KVCacheManager m(Model(2), Config({8, 0}, 64, {{8, 4}, {64, 8}}, 4, BackendKind::kVirtual));
  EXPECT_EQ(m.backend(), BackendKind::kVirtual);
  Add(m, 1, 6);
  m.AddToken(1, 1);
  m.AddToken(1, 1);
  m.AddToken(1, 1);  // 9 tokens: a third block
  const KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.max_num_blocks, 12);
  EXPECT_EQ(s.free_num_blocks, 12 - 6);
  EXPECT_EQ(s.used_num_blocks, 6);
  EXPECT_EQ(s.alloc_total_blocks, 6);
  EXPECT_EQ(s.alloc_new_blocks, 6);
  EXPECT_EQ(s.allocated_bytes, 0);
  EXPECT_EQ(s.num_free_blocks_per_window_size.at(8), 1);
  EXPECT_EQ(s.num_free_blocks_per_window_size.at(64), 5);
  EXPECT_THROW(m.GetLayerView(0), KVCacheError);
}

TEST(KVCacheManagerTest, HostBytesSurviveOtherSequences) {
  KVCacheManager m(Model(2, {2}, 4), Config({8, 0}, 64, {{8, 8}, {64, 8}}));
  Add(m, 1, 10);
  const LayerView v = m.GetLayerView(1);  // the full-attention layer
  const auto blocks = m.GetCacheBlockIds(1, 64);
  auto* base = static_cast<unsigned char*>(v.data);
  for (std::size_t j = 0; j < blocks.size(); ++j) {
    std::memset(base + blocks[j] * v.strides[0], static_cast<int>(0x10 + j), static_cast<std::size_t>(v.strides[1] * 2));
  }
  for (SeqId other = 2; other < 6; ++other) {
    Add(m, other, 7);
    m.RemoveSequence(other);
  }
  for (std::size_t j = 0; j < blocks.size(); ++j) {
    for (std::int64_t b = 0; b < v.strides[1] * 2; ++b) {
      ASSERT_EQ(base[blocks[j] * v.strides[0] + b], 0x10 + j);
    }
  }
}

}  // namespace
}  // namespace kvcache
