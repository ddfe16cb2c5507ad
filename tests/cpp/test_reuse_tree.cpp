#include "kvcache/reuse_tree.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kvcache/errors.h"

namespace kvcache {
namespace {

const std::vector<TokenId> kA = {1, 2, 3, 4};
const std::vector<TokenId> kB = {5, 6, 7, 8};
const std::vector<TokenId> kC = {5, 6};

TEST(ReuseTreeTest, CreateFindAndBlocksPerWindow) {
  ReuseTree t(2);
  EXPECT_EQ(t.NumNodes(), 1u);
  const NodeId a = t.GetOrCreateChild(ReuseTree::kRoot, 11, kA.data(), 4, 0, false);
  ASSERT_NE(a, kNoNode);
  EXPECT_EQ(t.GetOrCreateChild(ReuseTree::kRoot, 11, kA.data(), 4, 0, false), a);
  EXPECT_EQ(t.FindChild(ReuseTree::kRoot, 11, kA.data(), 4, 0), a);
  EXPECT_EQ(t.FindChild(ReuseTree::kRoot, 12, kA.data(), 4, 0), kNoNode);  // other hash
  EXPECT_EQ(t.FindChild(ReuseTree::kRoot, 11, kB.data(), 4, 0), kNoNode);  // collision guard
  EXPECT_EQ(t.FindChild(ReuseTree::kRoot, 11, kA.data(), 4, 9), kNoNode);  // other extras
  EXPECT_EQ(t.FindChild(a, 11, kA.data(), 4, 0), kNoNode);                 // other parent
  EXPECT_EQ(t.Depth(a), 1);
  EXPECT_EQ(t.Block(a, 0), kNullBlock);
  t.SetBlock(a, 1, 7);
  EXPECT_EQ(t.Block(a, 1), 7);
  EXPECT_FALSE(t.IsEmpty(a));
  const NodeId b = t.GetOrCreateChild(a, 22, kB.data(), 4, 0, false);
  const NodeId c = t.GetOrCreateChild(a, 23, kC.data(), 2, 0, true);
  t.SetBlock(b, 0, 3);
  t.SetBlock(c, 0, 4);
  EXPECT_EQ(t.Depth(b), 2);
  EXPECT_EQ(t.NumTokens(c), 2);
  EXPECT_TRUE(t.HasMultimodal(c));
  std::vector<NodeId> children;
  t.ForEachChild(a, [&](NodeId n) { children.push_back(n); });
  EXPECT_EQ(children, (std::vector<NodeId>{c, b}));
  // A different key with a colliding hash cannot be created.
  EXPECT_EQ(t.GetOrCreateChild(a, 22, kA.data(), 4, 0, false), kNoNode);
  EXPECT_EQ(t.NumNodes(), 4u);
  t.CheckInvariants();
}

TEST(ReuseTreeTest, PruneUpRemovesEmptyLeavesOnly) {
  ReuseTree t(1);
  const NodeId a = t.GetOrCreateChild(ReuseTree::kRoot, 1, kA.data(), 4, 0, false);
  const NodeId b = t.GetOrCreateChild(a, 2, kB.data(), 4, 0, false);
  const NodeId c = t.GetOrCreateChild(b, 3, kC.data(), 2, 0, false);
  t.SetBlock(a, 0, 0);
  t.SetBlock(c, 0, 2);
  // b is an empty interior node (a placeholder): kept while c hangs below it.
  t.PruneUp(b);
  EXPECT_EQ(t.NumNodes(), 4u);
  t.CheckInvariants();
  t.SetBlock(c, 0, kNullBlock);
  t.PruneUp(c);  // c and then b go; a holds a block and stays
  EXPECT_EQ(t.NumNodes(), 2u);
  EXPECT_TRUE(t.IsLeaf(a));
  EXPECT_EQ(t.FindChild(a, 2, kB.data(), 4, 0), kNoNode);
  t.CheckInvariants();
  // Freed nodes are recycled.
  const NodeId d = t.GetOrCreateChild(a, 4, kB.data(), 4, 0, false);
  EXPECT_TRUE(d == b || d == c);
  t.SetBlock(d, 0, 5);
  t.CheckInvariants();
}

TEST(ReuseTreeTest, DescendantsArePreorder) {
  ReuseTree t(1);
  const NodeId a = t.GetOrCreateChild(ReuseTree::kRoot, 1, kA.data(), 4, 0, false);
  const NodeId b = t.GetOrCreateChild(a, 2, kB.data(), 4, 0, false);
  const NodeId c = t.GetOrCreateChild(b, 3, kC.data(), 2, 0, false);
  const NodeId d = t.GetOrCreateChild(a, 4, kC.data(), 2, 0, false);
  for (NodeId n : {a, b, c, d}) t.SetBlock(n, 0, n);
  std::vector<NodeId> seen;
  t.ForEachDescendant(a, [&](NodeId n) { seen.push_back(n); });
  ASSERT_EQ(seen.size(), 3u);
  // Every node comes after its parent.
  auto pos = [&](NodeId n) { return std::find(seen.begin(), seen.end(), n) - seen.begin(); };
  EXPECT_LT(pos(b), pos(c));
  EXPECT_NE(std::find(seen.begin(), seen.end(), d), seen.end());
}

// The hash index under many inserts and erases: hashes that share their low or high bits
// (long probe runs, erases from the middle of a run, growth), a hash of 0, random order.
TEST(ReuseTreeTest, IndexFindsEveryLiveNodeThroughGrowthAndErases) {
  ReuseTree t(1);
  std::vector<std::uint64_t> hashes = {0};
  for (std::uint64_t i = 1; i < 1500; ++i) {
    hashes.push_back(i);                    // consecutive
    hashes.push_back(i << 40);              // equal low bits
    hashes.push_back(i * 0x9E3779B97F4A7C15ULL);  // the multiplier itself: equal high bits in pairs
  }
  std::uint64_t rng = 12345;
  auto next = [&rng] {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  };
  std::vector<std::pair<std::uint64_t, NodeId>> live;
  for (int round = 0; round < 3; ++round) {
    for (const std::uint64_t h : hashes) {
      const TokenId token = static_cast<TokenId>(h & 0x7fffffff);
      const NodeId n = t.GetOrCreateChild(ReuseTree::kRoot, h, &token, 1, 0, false);
      ASSERT_NE(n, kNoNode);
      t.SetBlock(n, 0, 1);
      live.emplace_back(h, n);
    }
    // Erase a random half (a leaf without blocks is deleted by PruneUp).
    for (std::size_t i = 0; i < live.size(); ++i) std::swap(live[i], live[next() % live.size()]);
    const std::size_t keep = live.size() / 2;
    for (std::size_t i = keep; i < live.size(); ++i) {
      t.SetBlock(live[i].second, 0, kNullBlock);
      t.PruneUp(live[i].second);
    }
    for (std::size_t i = keep; i < live.size(); ++i) {
      const TokenId token = static_cast<TokenId>(live[i].first & 0x7fffffff);
      EXPECT_EQ(t.FindChild(ReuseTree::kRoot, live[i].first, &token, 1, 0), kNoNode);
    }
    live.resize(keep);
    for (const auto& [h, n] : live) {
      const TokenId token = static_cast<TokenId>(h & 0x7fffffff);
      ASSERT_EQ(t.FindChild(ReuseTree::kRoot, h, &token, 1, 0), n);
    }
    t.CheckInvariants();
    EXPECT_EQ(t.NumNodes(), live.size() + 1);
    // The erased hashes come back in the next round; drop the live ones first.
    for (const auto& [h, n] : live) {
      t.SetBlock(n, 0, kNullBlock);
      t.PruneUp(n);
    }
    live.clear();
    EXPECT_EQ(t.NumNodes(), 1U);
  }
}

TEST(ReuseTreeTest, InvariantCheckCatchesEmptyLeaf) {
  ReuseTree t(1);
  t.GetOrCreateChild(ReuseTree::kRoot, 1, kA.data(), 4, 0, false);
  EXPECT_THROW(t.CheckInvariants(), InternalError);
}

}  // namespace
}  // namespace kvcache
