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

TEST(EvictionPolicyTest, MisuseIsAnInternalError) {
  EvictionPolicy p(2, 0);
  p.Push(0, 35);
  EXPECT_THROW(p.Push(0, 35), InternalError);
  EXPECT_THROW(p.Remove(1), InternalError);
  EXPECT_THROW(p.Push(1, 101), InternalError);
}

}  // namespace
}  // namespace kvcache
