// ForkSequence (beam search, parallel sampling) and copy-on-write: exact block ids, reference
// counts, release records and the bytes of copied blocks on the host backend.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

constexpr BlockId N = kNullBlock;

// Window 8 (sliding, 2 blocks of 4 tokens) and full attention (32), 16 blocks each; one layer per
// window.
ManagerConfig SwaConfig(std::int32_t blocks = 16) {
  ManagerConfig c = Config({8, 32}, 32, {{8, blocks}, {32, blocks}});
  return c;
}

// The bytes of token slot `t` of block `b` (K and V of every head) of `layer`.
std::vector<unsigned char> Slot(const KVCacheManager& m, std::int32_t layer, BlockId b, std::int32_t t) {
  const LayerView v = m.GetLayerView(layer);
  std::vector<unsigned char> out;
  const auto row = static_cast<std::size_t>(v.shape[4]) * 2;  // fp16 head_dim
  for (std::int64_t k = 0; k < v.shape[1]; ++k) {
    for (std::int64_t h = 0; h < v.shape[2]; ++h) {
      const auto* p = static_cast<const unsigned char*>(v.data) + b * v.strides[0] + k * v.strides[1] +
                      h * v.strides[2] + t * v.strides[3];
      out.insert(out.end(), p, p + row);
    }
  }
  return out;
}

void Fill(const KVCacheManager& m, std::int32_t layer, BlockId b, std::int32_t t, unsigned char value) {
  const LayerView v = m.GetLayerView(layer);
  const auto row = static_cast<std::size_t>(v.shape[4]) * 2;
  for (std::int64_t k = 0; k < v.shape[1]; ++k) {
    for (std::int64_t h = 0; h < v.shape[2]; ++h) {
      auto* p = static_cast<unsigned char*>(v.data) + b * v.strides[0] + k * v.strides[1] + h * v.strides[2] +
                t * v.strides[3];
      std::memset(p, value, row);
    }
  }
}

std::vector<unsigned char> Bytes(const KVCacheManager& m, unsigned char value) {
  const LayerView v = m.GetLayerView(0);
  return std::vector<unsigned char>(static_cast<std::size_t>(v.shape[1] * v.shape[2] * v.shape[4] * 2), value);
}

std::vector<SeqId> Ids(std::initializer_list<SeqId> ids) { return ids; }

TEST(ForkTest, ChildrenShareEveryBlockAndTakeNone) {
  KVCacheManager m(Model(2), SwaConfig());
  auto prompt = Iota(6);
  m.AddSequence(1, prompt.data(), prompt.size());
  ASSERT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{0, 1}));
  const auto children = Ids({2, 3});
  m.ForkSequence(1, children.data(), children.size());
  for (const SeqId c : children) {
    EXPECT_EQ(m.NumTokens(c), 6);
    EXPECT_EQ(m.PromptLength(c), 6);
    EXPECT_EQ(m.GetCacheBlockIds(c, 8), (std::vector<BlockId>{0, 1}));
    EXPECT_EQ(m.GetCacheBlockIds(c, 32), (std::vector<BlockId>{0, 1}));
  }
  EXPECT_EQ(m.GetNumFreeBlocks(8), 14);
  EXPECT_EQ(m.GetNumFreeBlocks(32), 14);
  // Two extra references of each of the 2 blocks in the sliding window.
  EXPECT_EQ(m.GetNumSharedBlocks(8), 4);
  const KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.forked_blocks, 2 * 2 * 2);  // children x blocks x windows
  EXPECT_EQ(s.copied_on_write_blocks, 0);
  EXPECT_EQ(s.alloc_new_blocks, 4);
  EXPECT_EQ(m.GetRequestStats(2).new_blocks, 0);
  m.CheckInvariants();
}

TEST(ForkTest, FirstWriteIntoASharedBlockCopiesItsTokens) {
  KVCacheManager m(Model(2), SwaConfig());
  auto prompt = Iota(6);
  m.AddSequence(1, prompt.data(), prompt.size());
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    for (std::int32_t t = 0; t < 4; ++t) Fill(m, layer, 1, t, static_cast<unsigned char>(0x10 + t + 8 * layer));
  }
  const auto children = Ids({2, 3});
  m.ForkSequence(1, children.data(), children.size());
  // One step over the three beams, one call: 1 and 2 write into shared block 1 and get copies
  // (blocks 2 and 3, in batch order); 3, the last holder, then writes it in place.
  const std::vector<SeqId> ids{1, 2, 3};
  const std::vector<TokenId> toks{100, 200, 300};
  m.AddTokens(ids.data(), toks.data(), ids.size());
  for (const WindowSize w : {8, 32}) {
    EXPECT_EQ(m.GetCacheBlockIds(1, w), (std::vector<BlockId>{0, 2})) << w;
    EXPECT_EQ(m.GetCacheBlockIds(2, w), (std::vector<BlockId>{0, 3})) << w;
    EXPECT_EQ(m.GetCacheBlockIds(3, w), (std::vector<BlockId>{0, 1})) << w;
  }
  // The copies hold the two tokens written before the fork, in both layers; the other slots
  // were not copied (the pool starts zeroed).
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    for (const BlockId b : {2, 3}) {
      EXPECT_EQ(Slot(m, layer, b, 0), Bytes(m, static_cast<unsigned char>(0x10 + 8 * layer)));
      EXPECT_EQ(Slot(m, layer, b, 1), Bytes(m, static_cast<unsigned char>(0x11 + 8 * layer)));
      EXPECT_EQ(Slot(m, layer, b, 2), Bytes(m, 0));
      EXPECT_EQ(Slot(m, layer, b, 3), Bytes(m, 0));
    }
  }
  const KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.copied_on_write_blocks, 4);  // 2 per window
  EXPECT_EQ(s.alloc_new_blocks, 4 + 4);
  EXPECT_EQ(m.GetRequestStats(2).new_blocks, 2);
  EXPECT_EQ(m.GetNumFreeBlocks(8), 12);
  // Block 0 (full, shared by three) is never written: no copy.
  EXPECT_EQ(m.GetNumSharedBlocks(8), 2);
  // The next token of each writes its private block in place; the one after starts new blocks.
  m.AddTokens(ids.data(), toks.data(), ids.size());
  EXPECT_EQ(m.GetStats().copied_on_write_blocks, 4);
  m.AddTokens(ids.data(), toks.data(), ids.size());
  EXPECT_EQ(m.GetCacheBlockIds(1, 32), (std::vector<BlockId>{0, 2, 4}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 32), (std::vector<BlockId>{0, 3, 5}));
  EXPECT_EQ(m.GetCacheBlockIds(3, 32), (std::vector<BlockId>{0, 1, 6}));
  m.CheckInvariants();
}

TEST(ForkTest, AWriterWhoseSiblingIsNotInTheCallCopies) {
  KVCacheManager m(Model(2), SwaConfig());
  auto prompt = Iota(6);
  m.AddSequence(1, prompt.data(), prompt.size());
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  m.AddToken(2, 7);  // 1 still holds block 1: 2 copies it
  EXPECT_EQ(m.GetCacheBlockIds(2, 8), (std::vector<BlockId>{0, 2}));
  m.AddToken(1, 9);  // now private to 1: written in place
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(m.GetStats().copied_on_write_blocks, 2);
  m.CheckInvariants();
}

TEST(ForkTest, BadForksRaiseAndChangeNothing) {
  ManagerConfig c = SwaConfig();
  c.max_batch_size = 3;
  KVCacheManager m(Model(2), c);
  testing::Add(m, 1, 6);
  testing::Add(m, 5, 3);
  const auto before = testing::Take(m, {1, 2, 3, 4, 5});
  auto fork = [&](SeqId parent, std::vector<SeqId> kids) { m.ForkSequence(parent, kids.data(), kids.size()); };
  EXPECT_THROW(fork(9, {2}), UnknownSequenceError);
  EXPECT_THROW(fork(1, {1}), std::invalid_argument);
  EXPECT_THROW(fork(1, {2, 5}), std::invalid_argument);  // 5 is registered: 2 is not forked either
  EXPECT_THROW(fork(1, {2, 2}), std::invalid_argument);
  EXPECT_THROW(fork(1, {-1}), std::invalid_argument);
  EXPECT_THROW(fork(1, {2, 3}), KVCacheError);  // 4 sequences > max_batch_size 3
  try {
    fork(1, {1});
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot fork request 1 into itself"), std::string::npos) << e.what();
  }
  try {
    fork(1, {2, 5});
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("child request id 5 is already registered"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(before == testing::Take(m, {1, 2, 3, 4, 5}));
  EXPECT_FALSE(m.HasSequence(2));
  EXPECT_EQ(m.GetStats().forked_blocks, 0);
  fork(1, {});  // no children: nothing to do
  fork(1, {2});
  EXPECT_EQ(m.NumSequences(), 3u);
  m.CheckInvariants();
}

TEST(ForkTest, PrunedBeamFreesOnlyWhatItAloneHolds) {
  KVCacheManager m(Model(2), SwaConfig());
  testing::Add(m, 1, 6);
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  const std::vector<SeqId> ids{1, 2};
  const std::vector<TokenId> toks{10, 20};
  m.AddTokens(ids.data(), toks.data(), ids.size());  // 1 copies block 1 into 2; 2 keeps block 1
  ASSERT_EQ(m.GetCacheBlockIds(1, 32), (std::vector<BlockId>{0, 2}));
  ASSERT_EQ(m.GetCacheBlockIds(2, 32), (std::vector<BlockId>{0, 1}));
  m.RemoveSequence(2);
  EXPECT_EQ(m.GetNumFreeBlocks(32), 14);  // block 1 only; block 0 stays with 1
  EXPECT_EQ(m.GetCacheBlockIds(1, 32), (std::vector<BlockId>{0, 2}));
  EXPECT_EQ(m.GetNumSharedBlocks(8), 0);
  m.CheckInvariants();
  m.RemoveSequence(1);
  EXPECT_EQ(m.GetNumFreeBlocks(32), 16);
  m.CheckInvariants();
}

TEST(ForkTest, SharedSlidingWindowBlockIsFreedWhenTheLastHolderPassesIt) {
  // Window 8 has 6 blocks, full attention 16.
  KVCacheManager m(Model(2), Config({8, 32}, 32, {{8, 6}, {32, 16}}));
  testing::Add(m, 1, 6);
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  // Beam 1 runs alone to 12 tokens: its first write copies block 1 (into 2), token 8 starts
  // block 3, and at 12 tokens window 8 has passed block 0 (tokens 0..3): 1 releases it, but 2
  // still holds it, so nothing is freed.
  for (TokenId t = 6; t < 12; ++t) m.AddToken(1, t);
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, 2, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 8), (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(m.GetNumUsedBlocks(8), 4);  // 0, 1, 2, 3
  m.CheckInvariants();
  // Beam 2 catches up: block 1 is its own now (written in place), token 8 starts block 4, and at
  // 12 tokens it releases block 0, whose last holder it was: freed.
  for (TokenId t = 6; t < 12; ++t) m.AddToken(2, t);
  EXPECT_EQ(m.GetCacheBlockIds(2, 8), (std::vector<BlockId>{N, 1, 4}));
  EXPECT_EQ(m.GetNumUsedBlocks(8), 4);  // 1, 2, 3, 4
  EXPECT_EQ(m.GetCacheBlockIds(1, 32), (std::vector<BlockId>{0, 2, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 32), (std::vector<BlockId>{0, 1, 4}));
  EXPECT_EQ(m.GetStats().copied_on_write_blocks, 2);
  m.CheckInvariants();  // block 0's release records name both beams
  EXPECT_TRUE(m.IsSequenceValidForReuse(1));
  EXPECT_TRUE(m.IsSequenceValidForReuse(2));
  // A new request takes window 8's free blocks 5 and then 0: both beams' record of block 0 ends.
  testing::Add(m, 3, 6);
  EXPECT_EQ(m.GetCacheBlockIds(3, 8), (std::vector<BlockId>{5, 0}));
  EXPECT_FALSE(m.IsSequenceValidForReuse(1));
  EXPECT_FALSE(m.IsSequenceValidForReuse(2));
  m.CheckInvariants();
}

TEST(ForkTest, ChildInheritsTheParentsReleaseRecords) {
  // Window 8 has 5 blocks, full attention 16.
  KVCacheManager m(Model(2), Config({8, 32}, 32, {{8, 5}, {32, 16}}));
  testing::Add(m, 1, 13);
  m.AddToken(1, 99);  // 14 tokens: window 8 releases block 0 (tokens 0..3)
  ASSERT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, 1, 2, 3}));
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  EXPECT_EQ(m.GetCacheBlockIds(2, 8), (std::vector<BlockId>{N, 1, 2, 3}));
  EXPECT_EQ(m.GetStats().forked_blocks, 3 + 4);  // window 8 shares 3 blocks, full attention 4
  m.CheckInvariants();  // block 0's releasers are exactly 1 and 2
  // A new request takes free blocks 4 and 0 in window 8: the child's copy of the record ends too.
  testing::Add(m, 3, 6);
  EXPECT_EQ(m.GetCacheBlockIds(3, 8), (std::vector<BlockId>{4, 0}));
  EXPECT_FALSE(m.IsSequenceValidForReuse(1));
  EXPECT_FALSE(m.IsSequenceValidForReuse(2));
  m.CheckInvariants();
  m.RemoveSequence(1, /*store_for_reuse=*/false);
  m.RemoveSequence(2, /*store_for_reuse=*/false);
  m.CheckInvariants();
  EXPECT_EQ(m.GetNumUsedBlocks(8), 2);
}

TEST(ForkTest, ForgettingOneBeamsReleaseKeepsTheOthers) {
  KVCacheManager m(Model(2), Config({8, 32}, 32, {{8, 5}, {32, 16}}));
  testing::Add(m, 1, 13);
  m.AddToken(1, 99);
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  m.RemoveSequence(1, /*store_for_reuse=*/false);
  m.CheckInvariants();  // block 0's releasers: 2 alone
  testing::Add(m, 3, 6);
  EXPECT_FALSE(m.IsSequenceValidForReuse(2));
  m.CheckInvariants();
}

TEST(ForkTest, RewindIntoASharedBlockCopiesTheKeptTokens) {
  KVCacheManager m(Model(2), SwaConfig());
  testing::Add(m, 1, 7);
  for (std::int32_t t = 0; t < 4; ++t) Fill(m, 1, 1, t, static_cast<unsigned char>(0x40 + t));
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  m.Rewind(2, 2);  // 5 tokens: block 1 keeps 1 token and is shared: copied into block 2
  EXPECT_EQ(m.GetCacheBlockIds(2, 32), (std::vector<BlockId>{0, 2}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 32), (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(Slot(m, 1, 2, 0), Bytes(m, 0x40));
  EXPECT_EQ(Slot(m, 1, 2, 1), Bytes(m, 0));
  EXPECT_EQ(m.GetStats().copied_on_write_blocks, 2);
  m.CheckInvariants();
}

TEST(ForkTest, PrefillIntoASharedBlockCopiesIt) {
  KVCacheManager m(Model(2), SwaConfig());
  auto prompt = Iota(11);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, /*prefill=*/6);
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  EXPECT_EQ(m.NumTokens(2), 6);
  EXPECT_EQ(m.PromptLength(2), 11);
  const std::vector<SeqId> ids{1, 2};
  const std::vector<std::int32_t> chunks{5, 5};
  m.Prefill(ids.data(), chunks.data(), ids.size());
  // 1 copies block 1 (into 2) and grows into 3; 2 then owns block 1 alone and grows into 4.
  EXPECT_EQ(m.GetCacheBlockIds(1, 32), (std::vector<BlockId>{0, 2, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 32), (std::vector<BlockId>{0, 1, 4}));
  EXPECT_EQ(m.GetStats().copied_on_write_blocks, 2);
  m.CheckInvariants();
}

TEST(ForkTest, CopiesCountInTheBlocksCheck) {
  // 4 blocks per window: the prompt takes 2, so two copies fit and a third does not.
  KVCacheManager m(Model(2), SwaConfig(4));
  testing::Add(m, 1, 6);
  const auto children = Ids({2, 3, 4});
  m.ForkSequence(1, children.data(), children.size());
  const auto before = testing::Take(m, {1, 2, 3, 4});
  const std::vector<SeqId> ids{1, 2, 3, 4};
  const std::vector<TokenId> toks{1, 2, 3, 4};
  try {
    m.AddTokens(ids.data(), toks.data(), ids.size());
    FAIL() << "expected OutOfBlocksError";
  } catch (const OutOfBlocksError& e) {
    EXPECT_NE(std::string(e.what()).find("add_tokens needs 3 new blocks in window 8 but only 2"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(before == testing::Take(m, {1, 2, 3, 4}));
  m.RemoveSequence(4, false);
  m.AddTokens(ids.data(), toks.data(), 3);  // 3 beams: 2 copies, the last writes in place
  EXPECT_EQ(m.GetNumFreeBlocks(8), 0);
  m.CheckInvariants();
}

TEST(ForkTest, VirtualBackendForksWithoutCopying) {
  ManagerConfig c = SwaConfig();
  c.backend = BackendKind::kVirtual;
  KVCacheManager m(Model(2), c);
  EXPECT_FALSE(m.MayCopyBlocks());
  testing::Add(m, 1, 6);
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  EXPECT_FALSE(m.MayCopyBlocks());
  m.AddToken(2, 1);
  EXPECT_EQ(m.GetCacheBlockIds(2, 8), (std::vector<BlockId>{0, 2}));
  EXPECT_EQ(m.GetStats().copied_on_write_blocks, 2);
  m.CheckInvariants();
}

TEST(ForkTest, HostBackendMayCopyAfterAFork) {
  KVCacheManager m(Model(2), SwaConfig());
  EXPECT_FALSE(m.MayCopyBlocks());
  testing::Add(m, 1, 6);
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  EXPECT_TRUE(m.MayCopyBlocks());
}

TEST(ForkTest, APrunedBeamDoesNotStoreAPartialBlockItsSiblingHolds) {
  ManagerConfig c = SwaConfig();
  c.enable_block_reuse = true;
  KVCacheManager m(Model(2), c);
  testing::Add(m, 1, 6);
  const SeqId child = 2;
  m.ForkSequence(1, &child, 1);
  // 2 stores 5 tokens: block 0 (full) is linked; block 1 (1 token keyed) is still 1's too, so it
  // is left to 1 (linked now it could not be linked under 1's longer key later).
  m.RemoveSequence(2, /*store_for_reuse=*/true);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 1);
  for (TokenId t = 6; t < 9; ++t) m.AddToken(1, t);  // block 1 is 1's alone: written in place
  EXPECT_EQ(m.GetCacheBlockIds(1, 32), (std::vector<BlockId>{0, 1, 2}));
  EXPECT_EQ(m.GetStats().copied_on_write_blocks, 0);
  m.RemoveSequence(1, /*store_for_reuse=*/true);  // 8 tokens keyed: blocks 0 and 1, full
  EXPECT_EQ(m.GetStats().num_cached_nodes, 2);
  m.CheckInvariants();  // full attention's cached chain has no hole
  auto prompt = Iota(9);
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 8);
}

}  // namespace
}  // namespace kvcache
