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

TEST(EvictionPolicyTest, MisuseIsAnInternalError) {
  EvictionPolicy p(2, 0);
  p.Push(0, 35);
  EXPECT_THROW(p.Push(0, 35), InternalError);
  EXPECT_THROW(p.Remove(1), InternalError);
  EXPECT_THROW(p.Push(1, 101), InternalError);
}

}  // namespace
}  // namespace kvcache
