#include "kvcache/eviction_policy.h"

#include <gtest/gtest.h>

#include <vector>

#include "kvcache/errors.h"

namespace kvcache {
namespace {

std::vector<BlockId> Order(const EvictionPolicy& p, CacheLevel level) {
  std::vector<BlockId> out;
  p.ForEach(level, [&](BlockId b) { out.push_back(b); });
  return out;
}

TEST(EvictionPolicyTest, LowestPriorityOldestFirst) {
  EvictionPolicy p(6, 0);
  p.Push(3, 50);
  p.Push(1, 20);
  p.Push(4, 20);
  p.Push(0, 35);
  p.Push(2, EvictionPolicy::kScratch);
  EXPECT_EQ(p.NumFree(CacheLevel::kPrimary), 5);
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{2, 1, 4, 0, 3}));
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 2);
  p.Remove(2);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 1);
  p.Remove(1);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 4);
  p.Remove(4);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 0);
  EXPECT_EQ(p.QueuedPriority(3), 50);
  EXPECT_EQ(p.NumFree(CacheLevel::kPrimary), 2);
}

TEST(EvictionPolicyTest, ToFrontAndMiddleRemoval) {
  EvictionPolicy p(5, 0);
  for (BlockId b = 0; b < 4; ++b) p.Push(b, 35);
  p.Push(4, 35, /*to_front=*/true);
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{4, 0, 1, 2, 3}));
  p.Remove(1);
  p.Remove(3);  // tail
  p.Remove(4);  // head
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{0, 2}));
  EXPECT_FALSE(p.Contains(1));
  EXPECT_TRUE(p.Contains(2));
  p.Remove(0);
  p.Remove(2);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), kNullBlock);
  EXPECT_EQ(p.NumFree(CacheLevel::kPrimary), 0);
}

TEST(EvictionPolicyTest, LevelsAreSeparate) {
  EvictionPolicy p(2, 3);
  p.Push(3, 100);
  p.Push(0, 100);
  p.Push(2, 0);
  EXPECT_EQ(p.LevelOf(1), CacheLevel::kPrimary);
  EXPECT_EQ(p.LevelOf(2), CacheLevel::kSecondary);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 0);
  EXPECT_EQ(p.Peek(CacheLevel::kSecondary), 2);
  EXPECT_EQ(p.NumFree(CacheLevel::kSecondary), 2);
  EXPECT_EQ(Order(p, CacheLevel::kSecondary), (std::vector<BlockId>{2, 3}));
}

TEST(EvictionPolicyTest, HighestPriorityQueueIsReachable) {
  EvictionPolicy p(2, 0);
  p.Push(1, 100);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 1);  // slot 101 lives in the second mask word
  p.Push(0, 64);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 0);
}

TEST(EvictionPolicyTest, ProtectedAfterProbationOfTheSamePriority) {
  EvictionPolicy p(8, 0, /*protected_fraction=*/0.5);
  p.Push(0, 35, false, /*protect=*/true);
  p.Push(1, 35);
  p.Push(2, 20, false, /*protect=*/true);
  p.Push(3, 35);
  p.Push(4, EvictionPolicy::kScratch, false, /*protect=*/true);  // scratch is never protected
  // scratch, then priority 20 (its protected block), then 35 probation, then 35 protected
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{4, 2, 1, 3, 0}));
  EXPECT_EQ(p.NumProtected(CacheLevel::kPrimary), 2);
  EXPECT_TRUE(p.QueuedProtected(0));
  EXPECT_FALSE(p.QueuedProtected(1));
  EXPECT_FALSE(p.QueuedProtected(4));
  EXPECT_EQ(p.QueuedPriority(0), 35);
  EXPECT_EQ(p.QueuedPriority(2), 20);
  p.Remove(0);
  EXPECT_EQ(p.NumProtected(CacheLevel::kPrimary), 1);
  EXPECT_EQ(p.NumFree(CacheLevel::kPrimary), 4);
}

TEST(EvictionPolicyTest, ProtectedCapDemotesTheOldestOfThatPriority) {
  EvictionPolicy p(6, 0, 0.5);  // cap: 3 protected primary blocks
  EXPECT_EQ(p.Push(0, 35, false, true), kNullBlock);
  EXPECT_EQ(p.Push(1, 35, false, true), kNullBlock);
  EXPECT_EQ(p.Push(2, 35), kNullBlock);
  EXPECT_EQ(p.Push(3, 35, false, true), kNullBlock);
  EXPECT_EQ(p.Push(4, 35, false, true), 0);  // a fourth: 0 goes to the back of probation
  EXPECT_FALSE(p.QueuedProtected(0));
  EXPECT_EQ(p.NumProtected(CacheLevel::kPrimary), 3);
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{2, 0, 1, 3, 4}));
  // Over the cap at a priority without other protected blocks: the block itself is demoted.
  EXPECT_EQ(p.Push(5, 100, false, true), 5);
  EXPECT_FALSE(p.QueuedProtected(5));
  EXPECT_EQ(p.NumProtected(CacheLevel::kPrimary), 3);
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{2, 0, 1, 3, 4, 5}));
}

TEST(EvictionPolicyTest, DefaultCapIsATenthRoundedUp) {
  EvictionPolicy p(11, 0);  // cap ceil(1.1) = 2
  EXPECT_EQ(p.Push(0, 35, false, true), kNullBlock);
  EXPECT_EQ(p.Push(1, 35, false, true), kNullBlock);
  EXPECT_EQ(p.Push(2, 35, false, true), 0);
  EvictionPolicy none(8, 0, 0.0);  // nothing may be protected
  EXPECT_EQ(none.Push(3, 35, false, true), 3);
  EXPECT_EQ(none.NumProtected(CacheLevel::kPrimary), 0);
}

TEST(EvictionPolicyTest, HighestProtectedQueueIsReachable) {
  EvictionPolicy p(4, 0);
  p.Push(1, 100, false, true);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 1);  // slot 202 lives in the fourth mask word
  EXPECT_TRUE(p.QueuedProtected(1));
  p.Push(0, 100);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 0);
}

TEST(EvictionPolicyTest, PopScratchTakesTheScratchQueueHeadOnly) {
  EvictionPolicy p(8, 0);
  for (BlockId b : {5, 2, 7, 0}) p.Push(b, EvictionPolicy::kScratch);
  p.Push(3, 10);  // cached: never popped as scratch
  std::vector<BlockId> out(8, kNullBlock);
  EXPECT_EQ(p.PopScratch(CacheLevel::kPrimary, 3, out.data()), 3);
  EXPECT_EQ((std::vector<BlockId>(out.begin(), out.begin() + 3)), (std::vector<BlockId>{5, 2, 7}));
  EXPECT_FALSE(p.Contains(5));
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{0, 3}));
  EXPECT_EQ(p.NumScratch(CacheLevel::kPrimary), 1);
  EXPECT_EQ(p.NumFree(CacheLevel::kPrimary), 2);
  // Asking for more than the scratch queue holds takes what it has; the queue is then empty.
  EXPECT_EQ(p.PopScratch(CacheLevel::kPrimary, 4, out.data()), 1);
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(p.NumScratch(CacheLevel::kPrimary), 0);
  EXPECT_EQ(p.Peek(CacheLevel::kPrimary), 3);
  EXPECT_EQ(p.PopScratch(CacheLevel::kPrimary, 2, out.data()), 0);
  // An emptied queue takes new blocks again at either end.
  p.Push(4, EvictionPolicy::kScratch);
  p.Push(6, EvictionPolicy::kScratch, /*to_front=*/true);
  EXPECT_EQ(Order(p, CacheLevel::kPrimary), (std::vector<BlockId>{6, 4, 3}));
}

TEST(EvictionPolicyTest, PushScratchNMatchesOnePushEach) {
  for (const bool to_front : {false, true}) {
    for (const bool empty_before : {false, true}) {
      EvictionPolicy one(10, 0, EvictionPolicy::kDefaultProtectedFraction, /*slab_blocks=*/5);
      EvictionPolicy batch(10, 0, EvictionPolicy::kDefaultProtectedFraction, /*slab_blocks=*/5);
      if (!empty_before) {
        for (EvictionPolicy* p : {&one, &batch}) {
          p->Push(8, EvictionPolicy::kScratch);
          p->Push(9, EvictionPolicy::kScratch);
          p->Push(1, 40);
        }
      }
      const std::vector<BlockId> blocks{3, 0, 4, 2};
      for (const BlockId b : blocks) one.PushScratch(b, to_front);
      batch.PushScratchN(CacheLevel::kPrimary, blocks.data(), static_cast<std::int32_t>(blocks.size()), to_front);
      SCOPED_TRACE(::testing::Message() << "to_front " << to_front << ", empty before " << empty_before);
      EXPECT_EQ(Order(batch, CacheLevel::kPrimary), Order(one, CacheLevel::kPrimary));
      EXPECT_EQ(Order(batch, CacheLevel::kPrimary),
                to_front ? (empty_before ? (std::vector<BlockId>{2, 4, 0, 3})
                                         : (std::vector<BlockId>{2, 4, 0, 3, 8, 9, 1}))
                         : (empty_before ? (std::vector<BlockId>{3, 0, 4, 2})
                                         : (std::vector<BlockId>{8, 9, 3, 0, 4, 2, 1})));
      EXPECT_EQ(batch.NumScratch(CacheLevel::kPrimary), one.NumScratch(CacheLevel::kPrimary));
      EXPECT_EQ(batch.NumFree(CacheLevel::kPrimary), one.NumFree(CacheLevel::kPrimary));
      // Slab 0 (blocks 0..4) is wholly free only with block 1 as well.
      EXPECT_EQ(batch.SlabFree(0), one.SlabFree(0));
      EXPECT_EQ(batch.NumFreeSlabs(), one.NumFreeSlabs());
      EXPECT_EQ(batch.SlabListed(0), !empty_before);
      // The links hold both ways: popping everything returns the same order.
      std::vector<BlockId> a(10);
      std::vector<BlockId> b(10);
      const std::int32_t ka = one.PopScratch(CacheLevel::kPrimary, 10, a.data());
      const std::int32_t kb = batch.PopScratch(CacheLevel::kPrimary, 10, b.data());
      EXPECT_EQ(ka, kb);
      EXPECT_EQ(a, b);
    }
  }
}

TEST(EvictionPolicyTest, MisuseIsAnInternalError) {
  EvictionPolicy p(2, 0);
  p.Push(0, 35);
  EXPECT_THROW(p.Push(0, 35), InternalError);
  EXPECT_THROW(p.Remove(1), InternalError);
  EXPECT_THROW(p.Push(1, 101), InternalError);
}

}  // namespace
}  // namespace kvcache
