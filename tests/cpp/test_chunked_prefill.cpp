// Chunked prefill: add_sequence(prefill=k) gives blocks for the reused prefix plus k prompt
// tokens, Prefill gives the next chunk after releasing what no query of it can attend. Exact
// block lists per window, free counts, errors that change nothing, and the per-sequence bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;
using testing::Snapshot;
using testing::Take;
using Blocks = std::vector<BlockId>;
constexpr BlockId N = kNullBlock;

std::int32_t Held(const Blocks& blocks) {
  return static_cast<std::int32_t>(std::count_if(blocks.begin(), blocks.end(), [](BlockId b) { return b != N; }));
}

TEST(ChunkedPrefillTest, WindowSmallerThanTheChunkReleasesBetweenChunks) {
  KVCacheManager m(Model(2), Config({4, 0}, 64, {{4, 20}, {64, 20}}, 4, BackendKind::kVirtual));
  const auto prompt = Iota(20);
  EXPECT_EQ(m.AddSequence(1, prompt.data(), prompt.size(), {}, 8), 0);
  EXPECT_EQ(m.NumTokens(1), 8);
  EXPECT_EQ(m.PromptLength(1), 20);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{0, 1}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1}));

  m.Prefill(1, 8);  // the chunk starts at position 8: positions < 5 are out of the window
  EXPECT_EQ(m.NumTokens(1), 16);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, 1, 2, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1, 2, 3}));
  EXPECT_EQ(m.GetNumFreeBlocks(4), 17);

  m.Prefill(1, 4);  // starts at 16: positions < 13 are out; block 0 went to the back of the queue
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, N, N, 3, 4}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1, 2, 3, 4}));
  EXPECT_EQ(m.GetNumFreeBlocks(4), 18);
  EXPECT_EQ(m.NumTokens(1), 20);
  EXPECT_THROW(m.Prefill(1, 1), std::invalid_argument);  // nothing left to prefill

  m.AddToken(1, 7);  // decode as usual: 21 tokens keep positions >= 17
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, N, N, N, 4, 5}));
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, WindowLargerThanAChunkThatIsNotAMultipleOfTheBlock) {
  KVCacheManager m(Model(2), Config({8, 0}, 64, {{8, 10}, {64, 10}}, 4, BackendKind::kVirtual));
  const auto prompt = Iota(14);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, 3);
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (Blocks{0}));
  m.Prefill(1, 3);
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (Blocks{0, 1}));
  m.Prefill(1, 3);
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (Blocks{0, 1, 2}));
  m.Prefill(1, 3);  // positions 9..11 fit block 2: nothing new, nothing released yet
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (Blocks{0, 1, 2}));
  EXPECT_EQ(m.GetNumFreeBlocks(8), 7);
  m.Prefill(1, 2);  // starts at 12: positions < 5 are out, so block 0 goes before block 3 comes
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (Blocks{N, 1, 2, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1, 2, 3}));
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, ReuseHitEndingMidChunk) {
  ManagerConfig c = Config({4, 0}, 64, {{4, 20}, {64, 20}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(2), c);
  const auto stored = Iota(13);
  m.AddSequence(1, stored.data(), stored.size());
  m.RemoveSequence(1);  // stores 3 full blocks (token 12 is the last: never a key)
  const auto prompt = Iota(20);
  // Cached free blocks count one each: window 4 needs position 2 (cached) and two fresh blocks.
  EXPECT_EQ(m.GetNumBlocksToAllocate(prompt.data(), prompt.size(), {}, 6),
            (std::map<WindowSize, std::int32_t>{{4, 3}, {64, 5}}));
  EXPECT_EQ(m.GetNumBlocksToAllocate(prompt.data(), prompt.size(), {}),
            (std::map<WindowSize, std::int32_t>{{4, 3}, {64, 5}}));
  EXPECT_EQ(m.AddSequence(2, prompt.data(), prompt.size(), {}, 6), 12);
  EXPECT_EQ(m.NumTokens(2), 18);  // the 12 reused tokens and the first chunk of 6
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (Blocks{N, N, 2, 4, 5}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (Blocks{0, 1, 2, 4, 5}));
  m.Prefill(2, 2);  // starts at 18: position 2's block (tokens 8..11) is out of the window
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (Blocks{N, N, N, 4, 5}));
  EXPECT_FALSE(m.GetStats().num_free_blocks_per_window_size.empty());
  EXPECT_EQ(m.GetRequestStats(2).reused_blocks, 3 + 3);  // per window, summed
  EXPECT_EQ(m.GetRequestStats(2).missed_blocks, 2 + 2);  // the whole prompt's lookup
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, StoreContextBlocksStoresWhatWasPrefilled) {
  ManagerConfig c = Config({0}, 64, {{64, 20}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(1), c);
  const auto prompt = Iota(20);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, 6);
  EXPECT_EQ(m.StoreContextBlocks(1), 1);  // tokens 0..5 were computed: one full block
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 4);
  m.Prefill(1, 6);
  EXPECT_EQ(m.StoreContextBlocks(1), 2);
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 12);
  m.Prefill(1, 8);
  EXPECT_EQ(m.StoreContextBlocks(1), 1);  // 19 key tokens: 4 full blocks
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 16);
  m.CheckInvariants();
}

// A store resumes where the sequence's last store stopped only past positions where nothing can
// be stored later. A position whose node holds another sequence's copy of the block (both
// prefilled the same prompt at once) is not such a position: once that copy is evicted, the
// next store links the sequence's own block there and everything after it.
TEST(ChunkedPrefillTest, StoreAfterAShadowingCopyWasEvictedLinksTheOwnBlocks) {
  ManagerConfig c = Config({0}, 64, {{64, 14}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(1), c);
  const auto prompt = Iota(20);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, 8);
  m.AddSequence(2, prompt.data(), prompt.size(), {}, 8);  // nothing stored yet: a miss
  EXPECT_EQ(m.StoreContextBlocks(1), 2);
  EXPECT_EQ(m.StoreContextBlocks(2), 0);  // request 1's blocks hold both positions
  m.Prefill(2, 4);
  EXPECT_EQ(m.StoreContextBlocks(2), 1);  // position 2: request 2's own block
  m.RemoveSequence(1, /*store_for_reuse=*/false);  // its cached blocks 0 and 1 are free now
  // Another request takes every free block: the cached blocks 0 and 1 are evicted (dropping
  // position 2 below them as well) and request 2's blocks are the only copies left.
  const auto other = Iota(44, 100);
  m.AddSequence(3, other.data(), other.size());
  EXPECT_EQ(m.GetNumFreeBlocks(64), 0);
  m.RemoveSequence(3, /*store_for_reuse=*/false);
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 0);
  EXPECT_EQ(m.StoreContextBlocks(2), 3);  // positions 0..2 from the root again
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 12);
  m.Prefill(2, 8);
  EXPECT_EQ(m.StoreContextBlocks(2), 1);  // 19 key tokens: position 3 only
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 16);
  m.CheckInvariants();
}

// A rewind below where the last store stopped changes the tokens there: the next store walks
// the new chain from the root instead of resuming past it.
TEST(ChunkedPrefillTest, StoreAfterARewindBelowTheLastStoreWalksTheNewChain) {
  ManagerConfig c = Config({0}, 64, {{64, 20}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(1), c);
  const auto prompt = Iota(10);
  m.AddSequence(1, prompt.data(), prompt.size());
  EXPECT_EQ(m.StoreContextBlocks(1), 2);  // 9 key tokens: positions 0 and 1
  for (TokenId t = 10; t < 18; ++t) m.AddToken(1, t);
  EXPECT_EQ(m.PinBlocks(1).at(64).size(), 4U);  // 17 key tokens: positions 0..3, pinned
  m.Rewind(1, 12);                              // 6 tokens left: position 1 is copied
  std::vector<TokenId> now = Iota(6);
  for (TokenId t = 50; t < 62; ++t) {
    m.AddToken(1, t);
    now.push_back(t);
  }
  m.RemoveSequence(1);  // stores the 17 key tokens of the new chain (the last block partial)
  EXPECT_EQ(m.GetReusablePrefixLength(now.data(), now.size(), {}), 17);
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, FailuresChangeNothing) {
  KVCacheManager m(Model(1), Config({0}, 64, {{64, 3}}, 4, BackendKind::kVirtual));
  const auto prompt = Iota(20);
  EXPECT_THROW(m.AddSequence(1, prompt.data(), prompt.size(), {}, 0), std::invalid_argument);
  EXPECT_EQ(m.NumSequences(), 0u);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, 8);
  const Snapshot before = Take(m, {1});
  EXPECT_THROW(m.Prefill(1, 8), OutOfBlocksError);  // needs 2 blocks, 1 free
  EXPECT_EQ(Take(m, {1}), before);
  EXPECT_THROW(m.Prefill(1, 0), std::invalid_argument);
  EXPECT_THROW(m.Prefill(1, 13), std::invalid_argument);  // 12 prompt tokens left
  EXPECT_THROW(m.Prefill(2, 1), UnknownSequenceError);
  EXPECT_THROW(m.AddToken(1, 5), std::invalid_argument);  // still in prefill
  EXPECT_THROW(m.Rewind(1, 1), std::invalid_argument);
  EXPECT_EQ(Take(m, {1}), before);
  m.Prefill(1, 4);
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1, 2}));
  EXPECT_EQ(m.NumTokens(1), 12);
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, ChunkThatFitsOnlyThroughItsOwnReleases) {
  // Window 4 with 3 blocks: after the first chunk 1 is free, and the second chunk needs 2. It
  // fits because the chunk first releases position 0; a chunk needing 3 does not, and fails
  // with nothing changed.
  KVCacheManager m(Model(2), Config({4, 0}, 64, {{4, 3}, {64, 20}}, 4, BackendKind::kVirtual));
  const auto prompt = Iota(28);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, 8);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{0, 1}));
  EXPECT_EQ(m.GetNumFreeBlocks(4), 1);
  const Snapshot before = Take(m, {1});
  EXPECT_THROW(m.Prefill(1, 12), OutOfBlocksError);  // 3 new blocks; 1 free + 1 released
  EXPECT_EQ(Take(m, {1}), before);
  m.Prefill(1, 8);  // starts at 8: position 0 leaves the window first
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, 1, 2, 0}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1, 2, 3}));
  EXPECT_EQ(m.GetNumFreeBlocks(4), 0);
  m.Prefill(1, 4);  // starts at 16: positions 1 and 2 leave, one block is needed
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, N, N, 0, 1}));
  EXPECT_EQ(m.GetNumFreeBlocks(4), 1);
  m.CheckInvariants();
}

// A step's chunks in one call: every sequence releases before any hands out, so the blocks
// come out as below (blocks 0 and 2 go to the back of the free queue before 4, 5, 6 are taken).
TEST(ChunkedPrefillTest, BatchReleasesEverySequenceFirstThenHandsOut) {
  KVCacheManager m(Model(2), Config({4, 0}, 64, {{4, 20}, {64, 20}}, 4, BackendKind::kVirtual));
  const auto a = Iota(20);
  const auto b = Iota(20, 100);
  m.AddSequence(1, a.data(), a.size(), {}, 8);
  m.AddSequence(2, b.data(), b.size(), {}, 8);
  const SeqId ids[] = {1, 2};
  const std::int32_t chunks[] = {8, 4};
  m.Prefill(ids, chunks, 2);
  EXPECT_EQ(m.NumTokens(1), 16);
  EXPECT_EQ(m.NumTokens(2), 12);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, 1, 4, 5}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (Blocks{N, 3, 6}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1, 4, 5}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (Blocks{2, 3, 6}));
  EXPECT_EQ(m.GetNumFreeBlocks(4), 15);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 13);
  EXPECT_EQ(m.GetStats().alloc_total_blocks, 2 * (2 + 2 + 3));
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, BatchFailuresChangeNothing) {
  KVCacheManager m(Model(1), Config({0}, 64, {{64, 6}}, 4, BackendKind::kVirtual));
  const auto a = Iota(20);
  const auto b = Iota(20, 100);
  m.AddSequence(1, a.data(), a.size(), {}, 8);
  m.AddSequence(2, b.data(), b.size(), {}, 4);
  const Snapshot before = Take(m, {1, 2});
  auto prefill = [&m](std::vector<SeqId> ids, std::vector<std::int32_t> chunks) {
    m.Prefill(ids.data(), chunks.data(), ids.size());
  };
  EXPECT_THROW(prefill({1, 2}, {8, 8}), OutOfBlocksError);  // 2 + 2 new blocks, 3 free
  EXPECT_THROW(prefill({1, 1}, {4, 4}), std::invalid_argument);  // the same id twice
  EXPECT_THROW(prefill({1, 2}, {4, 17}), std::invalid_argument);  // 16 prompt tokens left
  EXPECT_THROW(prefill({1, 2}, {4, 0}), std::invalid_argument);
  EXPECT_THROW(prefill({1, 3}, {4, 4}), UnknownSequenceError);
  EXPECT_EQ(Take(m, {1, 2}), before);
  prefill({1, 2}, {8, 4});  // 2 + 1 new blocks: fits exactly
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (Blocks{0, 1, 3, 4}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (Blocks{2, 5}));
  EXPECT_EQ(m.GetNumFreeBlocks(64), 0);
  prefill({}, {});  // an empty step changes nothing
  EXPECT_EQ(m.NumTokens(1), 16);
  m.CheckInvariants();
}

// A sliding-window block that two sequences share frees memory only when both release it: in one
// batch the check credits it, for one of them alone it does not.
TEST(ChunkedPrefillTest, BatchCreditsASharedBlockOnlyWhenEveryHolderReleasesIt) {
  ManagerConfig c = Config({4, 0}, 64, {{4, 4}, {64, 40}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(2), c);
  const auto a = Iota(40);
  auto b = Iota(40);
  for (std::size_t i = 20; i < b.size(); ++i) b[i] += 1000;  // shares a's first 20 tokens
  m.AddSequence(1, a.data(), a.size(), {}, 8);
  for (int i = 0; i < 4; ++i) m.Prefill(1, 4);  // 24 tokens: positions 0..3 left the window
  EXPECT_EQ(m.StoreContextBlocks(1), 6);
  EXPECT_EQ(m.AddSequence(2, b.data(), b.size(), {}, 4), 20);  // position 4 shared, 5 its own
  // Blocks 0..3 went round the window's queue as the chunks moved on; 2 is request 2's own.
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, N, N, N, 0, 1}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (Blocks{N, N, N, N, 0, 2}));
  EXPECT_EQ(m.GetNumFreeBlocks(4), 1);
  const Snapshot before = Take(m, {1, 2});
  // Two new blocks for request 1 alone: 1 free, and block 4 stays with request 2.
  EXPECT_THROW(m.Prefill(1, 8), OutOfBlocksError);
  EXPECT_EQ(Take(m, {1, 2}), before);
  // Two new blocks for both: both release position 4, so block 4 is credited.
  const SeqId ids[] = {1, 2};
  const std::int32_t chunks[] = {4, 4};
  m.Prefill(ids, chunks, 2);
  EXPECT_EQ(m.GetCacheBlockIds(1, 4), (Blocks{N, N, N, N, N, 1, 3}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 4), (Blocks{N, N, N, N, N, 2, 0}));  // block 0, released by both
  EXPECT_EQ(m.GetNumFreeBlocks(4), 0);
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, BatchStoreStoresEverySequenceOrNothing) {
  ManagerConfig c = Config({0}, 64, {{64, 20}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(1), c);
  const auto a = Iota(20);
  const auto b = Iota(20, 100);
  m.AddSequence(1, a.data(), a.size(), {}, 6);
  m.AddSequence(2, b.data(), b.size(), {}, 13);
  const SeqId unknown[] = {1, 7};
  EXPECT_THROW(m.StoreContextBlocks(unknown, 2), UnknownSequenceError);
  const SeqId twice[] = {2, 2};
  EXPECT_THROW(m.StoreContextBlocks(twice, 2), std::invalid_argument);
  EXPECT_EQ(m.GetReusablePrefixLength(a.data(), a.size(), {}), 0);  // nothing was stored
  EXPECT_EQ(m.GetReusablePrefixLength(b.data(), b.size(), {}), 0);
  const SeqId both[] = {1, 2};
  EXPECT_EQ(m.StoreContextBlocks(both, 2), 1 + 3);
  EXPECT_EQ(m.GetReusablePrefixLength(a.data(), a.size(), {}), 4);
  EXPECT_EQ(m.GetReusablePrefixLength(b.data(), b.size(), {}), 12);
  EXPECT_EQ(m.StoreContextBlocks(both, 2), 0);  // nothing new
  m.CheckInvariants();
}

TEST(ChunkedPrefillTest, SlidingWindowHoldsAtMostWindowPlusChunkWhateverThePrompt) {
  constexpr std::int32_t kWindow = 8;
  constexpr std::int32_t kTpb = 4;
  for (const std::int32_t chunk : {3, 4, 16, 21}) {
    KVCacheManager m(Model(2), Config({kWindow, 0}, 256, {{kWindow, 64}, {256, 64}}, kTpb, BackendKind::kVirtual));
    const auto prompt = Iota(200);
    m.AddSequence(1, prompt.data(), prompt.size(), {}, chunk);
    const std::int32_t bound = (kWindow + chunk + kTpb - 1) / kTpb + 1;
    std::int32_t most = Held(m.GetCacheBlockIds(1, kWindow));
    while (m.NumTokens(1) < 200) {
      m.Prefill(1, std::min(chunk, 200 - m.NumTokens(1)));
      most = std::max(most, Held(m.GetCacheBlockIds(1, kWindow)));
      m.CheckInvariants();
    }
    EXPECT_LE(most, bound) << "chunk " << chunk;
    EXPECT_GE(most, bound - 2) << "chunk " << chunk;  // the bound is close to what is needed
    EXPECT_EQ(m.GetNumFreeBlocks(256), 64 - 50);
  }
}

}  // namespace
}  // namespace kvcache
