// block_math.h against brute force (a sequence grown token by token, every way of cutting a
// prompt into chunks), and the manager's estimates against the blocks it actually takes.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "kvcache/block_math.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

namespace bm = block_math;
using testing::Config;
using testing::Iota;
using testing::Model;

std::int64_t Held(std::int64_t tokens, std::int32_t released, std::int32_t tpb) {
  return bm::CeilDiv(tokens, tpb) - released;
}

// Blocks held after each token from lo to hi, the front moving by the decode rule.
std::int64_t BrutePeakLive(std::int64_t lo, std::int64_t hi, std::int64_t keep, std::int32_t tpb,
                           std::int32_t front) {
  std::int64_t best = 0;
  for (std::int64_t m = lo; m <= hi; ++m) {
    best = std::max(best, Held(m, std::max(front, bm::Released(m, keep, tpb)), tpb));
  }
  return best;
}

// Worst case over every cutting of [start, end) into chunks of at most `chunk` tokens; a chunk
// from a to b first releases what a sequence of a + 1 tokens releases.
std::int64_t BrutePrefillPeak(std::int64_t start, std::int64_t end, std::int64_t chunk, std::int64_t keep,
                              std::int32_t tpb, std::int32_t front) {
  std::function<std::int64_t(std::int64_t, std::int32_t)> walk = [&](std::int64_t a, std::int32_t f) {
    std::int64_t best = 0;
    for (std::int64_t b = a + 1; b <= std::min(end, a + chunk); ++b) {
      const std::int32_t released = std::max(f, bm::Released(a + 1, keep, tpb));
      std::int64_t here = Held(b, released, tpb);
      if (b < end) here = std::max(here, walk(b, released));
      best = std::max(best, here);
    }
    return best;
  };
  return walk(start, front);
}

TEST(BlockMathTest, ReleasedAndKeep) {
  EXPECT_EQ(bm::Released(10, 6, 4), 1);  // positions 0..3 lie below 10 - 6 = 4
  EXPECT_EQ(bm::Released(9, 6, 4), 0);
  EXPECT_EQ(bm::Released(1 << 20, bm::kKeepAll, 4), 0);
  EXPECT_EQ(bm::Keep(512, 3, 4096), 515);
  EXPECT_EQ(bm::Keep(512, 3, 515), bm::kKeepAll);  // never releases below max_seq_len
  EXPECT_FALSE(bm::Releases(bm::kKeepAll));
}

TEST(BlockMathTest, PeakLiveBlocksMatchesTokenByTokenGrowth) {
  for (std::int32_t tpb : {1, 3, 4, 8}) {
    for (std::int64_t keep : std::vector<std::int64_t>{1, 5, 6, 8, 13, 40}) {
      for (std::int32_t front = 0; front < 4; ++front) {
        for (std::int64_t lo = 1; lo < 60; lo += 3) {
          if (front >= bm::CeilDiv(lo, tpb)) continue;  // the newest token's block is always held
          for (std::int64_t hi = lo; hi < 70; hi += 5) {
            ASSERT_EQ(bm::PeakLiveBlocks(lo, hi, keep, tpb, front), BrutePeakLive(lo, hi, keep, tpb, front))
                << "lo " << lo << " hi " << hi << " keep " << keep << " tpb " << tpb << " front " << front;
          }
        }
      }
    }
  }
  EXPECT_EQ(bm::PeakLiveBlocks(1, 13, 6, 4), 3);
  EXPECT_EQ(bm::PeakLiveBlocks(1, 100, 5, 4), 2);
  EXPECT_EQ(bm::PeakLiveBlocks(1, 100, bm::kKeepAll, 4), 25);  // full attention: everything
}

TEST(BlockMathTest, PrefillPeakIsTheWorstCutting) {
  for (std::int32_t tpb : {1, 4, 5}) {
    for (std::int64_t keep : std::vector<std::int64_t>{3, 6, 9, bm::kKeepAll}) {
      for (std::int64_t chunk : std::vector<std::int64_t>{1, 2, 5, 7}) {
        for (std::int64_t start = 0; start < 8; start += 3) {
          for (std::int64_t end = start + 1; end < 19; end += 2) {
            ASSERT_EQ(bm::PrefillPeak(start, end, chunk, keep, tpb, 0), BrutePrefillPeak(start, end, chunk, keep, tpb, 0))
                << "start " << start << " end " << end << " chunk " << chunk << " keep " << keep << " tpb " << tpb;
          }
        }
      }
    }
  }
}

TEST(BlockMathTest, DemandOfManySequencesUnderAStepBudget) {
  // 128 sequences of 2,818 tokens, window 512, 32-token blocks, 8,192 tokens a step:
  // (128 x (512 + 62) + 8192) / 32 = 2,552 blocks; full attention 128 x ceil(2818 / 32).
  EXPECT_EQ(bm::DemandBlocks(128, 2818, 512, 8192, 32), 2552);
  EXPECT_EQ(bm::DemandBlocks(128, 2818, bm::kKeepAll, 8192, 32), 128 * 89);
  EXPECT_EQ(bm::DemandBlocks(4, 40, 512, 8192, 32), 4 * 2);  // never more than whole sequences
  // The bound holds what a decoding sequence holds at most, and a chunk's peak on top.
  for (std::int64_t keep : std::vector<std::int64_t>{5, 31, 32, 33, 100}) {
    EXPECT_GE(bm::DemandBlocks(1, 10000, keep, 0, 32), bm::PeakLiveBlocks(1, 10000, keep, 32)) << keep;
    EXPECT_GE(bm::DemandBlocks(1, 10000, keep, 512, 32), bm::BlocksToRunAlone(10000, 10000, 512, keep, keep, 32))
        << keep;
  }
}

TEST(BlockMathTest, RunAloneBoundsASlidingWindowByWindowPlusChunk) {
  // A 131,072-token prompt, window 128, 16-token blocks, 8,192-token chunks: the chunk, not the
  // window, sets the peak: ceil((128 + 8192 - 1) / 16) + 1 = 521 blocks; whole: 8,192 blocks.
  EXPECT_EQ(bm::BlocksToRunAlone(131072, 131072, 8192, 128, 128, 16), 521);
  EXPECT_EQ(bm::BlocksToRunAlone(131072, 131072, 0, 128, 128, 16), 8192);
  EXPECT_EQ(bm::BlocksToRunAlone(131072, 131072, 8192, 131072, bm::kKeepAll, 16), 8192);
  // A short prompt decoding far past the window: ceil((keep - 1) / tpb) + 1.
  EXPECT_EQ(bm::BlocksToRunAlone(10, 1000, 0, 8, 8, 4), 3);
}

// The manager's estimates against the blocks it actually takes: a prompt prefilled chunk by
// chunk, then decoded, never takes more than GetRemainingBlocks said before it started, and
// the peak equals it exactly when nothing is shared.
TEST(ManagerEstimatesTest, RemainingBlocksIsThePeakTheManagerTakes) {
  std::vector<std::int64_t> observed;
  std::vector<std::int64_t> bounds;
  for (std::int32_t chunk : {3, 4, 7, 0}) {
    KVCacheManager m(Model(2), Config({8, 0}, 64, {{8, 40}, {64, 40}}, 4, BackendKind::kVirtual));
    const auto prompt = Iota(30);
    const std::int32_t final_tokens = 45;
    const std::vector<std::int64_t> alone = m.GetBlocksToRunAlone(30, final_tokens, chunk);
    m.AddSequence(1, prompt.data(), prompt.size(), {}, chunk > 0 ? std::optional<std::int32_t>(chunk) : std::nullopt);
    const SeqId id = 1;
    std::vector<std::int64_t> predicted = m.GetRemainingBlocks(&id, &final_tokens, 1, chunk, false);
    std::vector<std::int64_t> peak(2, 0);
    auto observe = [&] {
      for (std::size_t w = 0; w < 2; ++w) {
        peak[w] = std::max<std::int64_t>(peak[w], 40 - m.GetNumFreeBlocks(m.window_sizes()[w]));
      }
    };
    observe();
    const std::vector<std::int64_t> first_held = peak;
    while (m.NumTokens(1) < m.PromptLength(1)) {
      const std::int32_t size = std::min(chunk, m.PromptLength(1) - m.NumTokens(1));
      const std::vector<std::int64_t> step = m.GetSequenceStepNeeds(1, size, true);
      const std::int32_t free8 = m.GetNumFreeBlocks(8);
      m.Prefill(1, size);
      // What the chunk takes from the free blocks (its releases first); 0 when it frees more.
      EXPECT_EQ(std::max(0, free8 - m.GetNumFreeBlocks(8)), step[0]) << "chunk " << chunk;
      observe();
    }
    while (m.NumTokens(1) < final_tokens) {
      m.AddToken(1, 5);
      observe();
    }
    // The estimates are the worst case over every cutting of the prompt into such chunks: never
    // below what this cutting takes, and exact for full attention and whole prompts.
    for (std::size_t w = 0; w < 2; ++w) {
      EXPECT_LE(peak[w], alone[w]) << "chunk " << chunk << " window " << w;
      EXPECT_LE(peak[w] - first_held[w], predicted[w]) << "chunk " << chunk << " window " << w;
      if (w == 1 || chunk == 0) {
        EXPECT_EQ(peak[w], alone[w]) << "chunk " << chunk << " window " << w;
        EXPECT_EQ(peak[w] - first_held[w], predicted[w]) << "chunk " << chunk << " window " << w;
      }
    }
    observed.push_back(peak[0]);
    bounds.push_back(alone[0]);
    EXPECT_EQ(peak[1], 12);  // ceil(45 / 4): full attention holds everything
    m.CheckInvariants();
  }
  // Window 8 (4-token blocks), chunks of 3, 4, 7 and the whole 30-token prompt.
  EXPECT_EQ(observed, (std::vector<std::int64_t>{4, 3, 5, 8}));
  EXPECT_EQ(bounds, (std::vector<std::int64_t>{4, 4, 5, 8}));
}

TEST(ManagerEstimatesTest, SharedBlocksComeFromRealReferenceCounts) {
  ManagerConfig c = Config({8, 0}, 64, {{8, 30}, {64, 30}}, 4, BackendKind::kVirtual);
  c.enable_block_reuse = true;
  KVCacheManager m(Model(2), c);
  const auto prompt = Iota(12);
  m.AddSequence(1, prompt.data(), prompt.size());
  m.StoreContextBlocks(1);  // blocks 0 and 1 (positions 0..7) are stored
  EXPECT_EQ(m.GetNumSharedBlocks(8), 0);
  EXPECT_EQ(m.AddSequence(2, prompt.data(), prompt.size()), 8);
  // Both hold the window-8 blocks of positions 0..7: two blocks held twice. Full attention never
  // releases, so sharing there needs no reserve.
  EXPECT_EQ(m.GetNumSharedBlocks(8), 2);
  EXPECT_EQ(m.GetNumSharedBlocks(64), 0);
  // Sequence 1's next token releases position 0 of window 8 (13 - 8 = 5 > 4), a block sequence 2
  // still holds: no credit. Without sharing it would need max(0, 1 - 1) = 0 new blocks; now 1.
  EXPECT_EQ(m.GetSequenceStepNeeds(1, 1, true), (std::vector<std::int64_t>{1, 1}));
  const SeqId ids[] = {1, 2};
  const std::int32_t tokens[] = {1, 1};
  // Together they release position 0 of both; the block is freed only if both let go, which the
  // step check does not assume per sequence: 2 new blocks each window, 0 credited.
  EXPECT_EQ(m.GetStepNeeds(ids, tokens, 2, nullptr, nullptr, 0), (std::vector<std::int64_t>{2, 2}));
  m.RemoveSequence(2);
  EXPECT_EQ(m.GetNumSharedBlocks(8), 0);
  EXPECT_EQ(m.GetSequenceStepNeeds(1, 1, true), (std::vector<std::int64_t>{0, 1}));
  m.CheckInvariants();
}

TEST(ManagerEstimatesTest, BadArgumentsThrowAndChangeNothing) {
  KVCacheManager m(Model(2), Config({8, 0}, 64, {{8, 10}, {64, 10}}, 4, BackendKind::kVirtual));
  const auto prompt = Iota(10);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, 4);
  const SeqId unknown = 9;
  const std::int32_t one = 1;
  EXPECT_THROW(m.GetStepNeeds(&unknown, &one, 1, nullptr, nullptr, 0), UnknownSequenceError);
  const SeqId id = 1;
  EXPECT_THROW(m.GetStepNeeds(&id, &one, 1, nullptr, nullptr, 0), std::invalid_argument);  // in prefill
  const std::int32_t too_long = 7;
  EXPECT_THROW(m.GetStepNeeds(nullptr, nullptr, 0, &id, &too_long, 1), std::invalid_argument);
  EXPECT_THROW(m.GetSequenceStepNeeds(1, 7, true), std::invalid_argument);
  EXPECT_THROW(m.GetNumSharedBlocks(5), std::invalid_argument);
  EXPECT_EQ(m.GetNumHeldBlocks(1, 8), 1);
  EXPECT_EQ(m.NumTokens(1), 4);
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache

namespace kvcache {
namespace {

TEST(ManagerEstimatesTest, FinalTokensProgressAndLengthChecks) {
  KVCacheManager m(testing::Model(2), testing::Config({8, 0}, 64, {{8, 20}, {64, 20}}, 4, BackendKind::kVirtual));
  const auto prompt = testing::Iota(10);
  m.AddSequence(1, prompt.data(), prompt.size(), {}, 4);
  m.AddSequence(2, prompt.data(), prompt.size());
  const SeqId ids[] = {1, 2};
  std::int32_t num_tokens[2] = {0, 0};
  std::int32_t prompt_len[2] = {0, 0};
  m.GetProgress(ids, 2, num_tokens, prompt_len);
  EXPECT_EQ(num_tokens[0], 4);
  EXPECT_EQ(num_tokens[1], 10);
  EXPECT_EQ(prompt_len[0], 10);
  EXPECT_EQ(prompt_len[1], 10);
  // Without a recorded final length a sequence is assumed to grow to max_seq_len: 64 tokens
  // are 16 blocks of full attention, 13 more than the 3 its 10 tokens hold.
  const SeqId two = 2;
  EXPECT_EQ(m.GetRemainingBlocks(&two, nullptr, 1, 0, false)[1], 16 - 3);
  m.SetFinalTokens(2, 19);  // 10 + 10 - 1: ceil(19 / 4) = 5 blocks in all
  EXPECT_EQ(m.GetRemainingBlocks(&two, nullptr, 1, 0, false)[1], 5 - 3);
  EXPECT_THROW(m.SetFinalTokens(2, 9), std::invalid_argument);   // below what it holds
  EXPECT_THROW(m.SetFinalTokens(2, 65), std::invalid_argument);  // beyond max_seq_len
  EXPECT_THROW(m.SetFinalTokens(7, 20), UnknownSequenceError);
  const std::int32_t right[] = {4, 10};
  const std::int32_t wrong[] = {4, 11};
  EXPECT_EQ(m.FirstLengthMismatch(ids, right, 2), -1);
  EXPECT_EQ(m.FirstLengthMismatch(ids, wrong, 2), 1);
  const SeqId unknown[] = {1, 9};
  EXPECT_EQ(m.FirstLengthMismatch(unknown, right, 2), 1);
  // The scheduler's one pass: the same remaining blocks, with the progress of GetProgress.
  std::int32_t tokens_out[2] = {0, 0};
  std::int32_t prompt_out[2] = {0, 0};
  EXPECT_EQ(m.GetRemainingBlocks(ids, nullptr, 2, 0, tokens_out, prompt_out),
            m.GetRemainingBlocks(ids, nullptr, 2, 0, false));
  EXPECT_EQ(tokens_out[0], 4);
  EXPECT_EQ(tokens_out[1], 10);
  EXPECT_EQ(prompt_out[0], 10);
  EXPECT_EQ(prompt_out[1], 10);
  // The check and the append in one call: a mismatch or an unknown id adds nothing.
  const TokenId toks[] = {5, 6};
  EXPECT_EQ(m.AddTokensIfLengths(ids, toks, wrong, 2), 1);
  EXPECT_EQ(m.AddTokensIfLengths(unknown, toks, right, 2), 1);
  EXPECT_THROW(m.AddTokensIfLengths(ids, toks, right, 2), std::invalid_argument);  // 1 is in prefill
  EXPECT_EQ(m.NumTokens(1), 4);
  EXPECT_EQ(m.NumTokens(2), 10);
  EXPECT_EQ(m.AddTokensIfLengths(&two, toks, &right[1], 1), -1);
  EXPECT_EQ(m.NumTokens(2), 11);
  // Sequence 1 has no final length: never reached; 2 reaches its 19 only at 19 tokens.
  EXPECT_TRUE(m.ReachedFinalTokens(ids, 2).empty());
  const TokenId token = 5;
  for (int k = 0; k < 7; ++k) m.AddTokens(&two, &token, 1);  // 18 tokens
  EXPECT_TRUE(m.ReachedFinalTokens(ids, 2).empty());
  m.AddTokens(&two, &token, 1);  // 19
  EXPECT_EQ(m.ReachedFinalTokens(ids, 2), (std::vector<std::int64_t>{1}));
  const SeqId reversed[] = {2, 1, 2};
  EXPECT_EQ(m.ReachedFinalTokens(reversed, 3), (std::vector<std::int64_t>{0, 2}));
  EXPECT_THROW(m.ReachedFinalTokens(unknown, 2), UnknownSequenceError);
  m.CheckInvariants();
}

}  // namespace
TEST(BlockMathTest, ForkedBeamBlocksCountOnlyTheBeamsOwnBlocks) {
  // 4-token blocks. Full attention: a beam forked at 6 tokens copies block 1 and starts block 2
  // by 12 tokens (2), and 7 blocks by 30; forked at 8 (block-aligned) no copy: 1 by 12.
  EXPECT_EQ(block_math::ForkedBeamBlocks(6, 12, block_math::kKeepAll, 4), 2);
  EXPECT_EQ(block_math::ForkedBeamBlocks(6, 30, block_math::kKeepAll, 4), 7);
  EXPECT_EQ(block_math::ForkedBeamBlocks(8, 12, block_math::kKeepAll, 4), 1);
  EXPECT_EQ(block_math::ForkedBeamBlocks(8, 8, block_math::kKeepAll, 4), 0);
  EXPECT_EQ(block_math::ForkedBeamBlocks(9, 3, block_math::kKeepAll, 4), 0);
  // Window 8: never more than the 3 blocks a window of 8 tokens spans, however long it grows.
  EXPECT_EQ(block_math::ForkedBeamBlocks(6, 12, 8, 4), 2);
  EXPECT_EQ(block_math::ForkedBeamBlocks(6, 30, 8, 4), 3);
  EXPECT_EQ(block_math::ForkedBeamBlocks(100, 1000, 8, 4), 3);
}

}  // namespace kvcache
