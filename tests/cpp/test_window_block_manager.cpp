// The batched hand-out and return (AcquireN, ReleaseN) against one call per block, on twin
// windows driven through the same history: the same blocks in the same order, the same
// displaced releasers, generations, tree links and free-queue orders.
#include "kvcache/window_block_manager.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/memory_backend.h"
#include "kvcache/reuse_tree.h"

namespace kvcache {
namespace {

constexpr std::int32_t kBlocks = 12;

struct Twin {
  std::unique_ptr<MemoryBackend> backend = MakeVirtualBackend();
  ReuseTree tree{1};
  std::unique_ptr<WindowBlockManager> wm;
  NodeId n1 = kNoNode;
  NodeId n2 = kNoNode;
  NodeId n3 = kNoNode;

  explicit Twin(bool is_swa) {
    PoolLayout pool;
    pool.num_kv_heads = 1;
    pool.layers = {0};
    pool.tokens_per_block = 4;
    pool.head_dim = 8;
    pool.elem_bytes = 2;
    WindowReuseOptions options;  // full attention cascades; "invalidate" sliding windows too
    wm = std::make_unique<WindowBlockManager>(is_swa ? 8 : 64, is_swa, 0, std::vector<PoolLayout>{pool}, kBlocks, 0,
                                              backend.get(), &tree, options, nullptr);
    const std::vector<TokenId> t{1, 2, 3, 4};
    n1 = tree.GetOrCreateChild(ReuseTree::kRoot, 11, t.data(), 4, 0, false);
    n2 = tree.GetOrCreateChild(n1, 12, t.data(), 4, 0, false);
    n3 = tree.GetOrCreateChild(ReuseTree::kRoot, 13, t.data(), 4, 0, false);
  }

  // A history that leaves free blocks of every kind: scratch (one with a live releaser),
  // cached blocks in a chain (evicting the parent unlinks the child, which becomes scratch
  // and is handed out next), a cached block at a lower priority.
  void Prepare() {
    std::vector<SeqId> displaced;
    std::vector<BlockId> b(8);
    wm->AcquireN(8, kDefaultPriority, 0, b.data(), &displaced);
    wm->Link(b[1], n1);
    wm->Link(b[2], n2);
    wm->Link(b[5], n3);
    wm->SetPriority(b[5], 10, 0);
    wm->Release(b[3], false, /*released_by=*/7);  // out of window: 7 keeps a record
    wm->Release(b[1]);
    wm->Release(b[2]);
    wm->Release(b[5]);
    wm->Release(b[0], /*to_front=*/true);
  }

  std::vector<BlockId> FreeOrder() const {
    std::vector<BlockId> out;
    wm->policy().ForEach(CacheLevel::kPrimary, [&](BlockId x) { out.push_back(x); });
    return out;
  }
};

TEST(WindowBlockManagerTest, AcquireNHandsOutWhatAcquireWould) {
  for (const bool is_swa : {false, true}) {
    SCOPED_TRACE(is_swa ? "sliding" : "full");
    Twin one(is_swa);
    Twin batch(is_swa);
    one.Prepare();
    batch.Prepare();
    ASSERT_EQ(one.FreeOrder(), batch.FreeOrder());
    const std::int32_t n = one.wm->NumFreePrimary();  // every free block: scratch, then victims
    std::vector<SeqId> displaced_one;
    std::vector<SeqId> displaced_batch;
    std::vector<BlockId> got_one;
    for (std::int32_t i = 0; i < n; ++i) got_one.push_back(one.wm->Acquire(50, 0, &displaced_one));
    std::vector<BlockId> got_batch(static_cast<std::size_t>(n));
    batch.wm->AcquireN(n, 50, 0, got_batch.data(), &displaced_batch);
    EXPECT_EQ(got_batch, got_one);
    EXPECT_EQ(displaced_batch, displaced_one);
    EXPECT_EQ(displaced_batch, (std::vector<SeqId>{7}));
    for (BlockId b = 0; b < kBlocks; ++b) {
      EXPECT_EQ(batch.wm->Generation(b), one.wm->Generation(b)) << "block " << b;
      EXPECT_EQ(batch.wm->RefCount(b), one.wm->RefCount(b)) << "block " << b;
      EXPECT_EQ(batch.wm->Priority(b), one.wm->Priority(b)) << "block " << b;
      EXPECT_EQ(batch.wm->NodeOf(b), kNoNode) << "block " << b;
    }
    EXPECT_EQ(batch.wm->NumFreePrimary(), 0);
    // Scratch first (the released-to-front block 0, then 8..11 in id order, then block 3 with
    // its releaser), then the cached victims: the priority-10 block 5, then block 1, whose
    // eviction unlinks its child's block 2 (scratch now, so next).
    EXPECT_EQ(got_batch, (std::vector<BlockId>{0, 8, 9, 10, 11, 3, 5, 1, 2}));
  }
}

TEST(WindowBlockManagerTest, AcquireNFailsWithNothingChanged) {
  Twin t(false);
  t.Prepare();
  const std::vector<BlockId> before = t.FreeOrder();
  std::vector<SeqId> displaced;
  std::vector<BlockId> out(kBlocks);
  EXPECT_THROW(t.wm->AcquireN(t.wm->NumFreePrimary() + 1, 50, 0, out.data(), &displaced), InternalError);
  EXPECT_EQ(t.FreeOrder(), before);
  EXPECT_TRUE(displaced.empty());
}

TEST(WindowBlockManagerTest, ReleaseNReturnsWhatReleaseWould) {
  for (const bool reverse : {false, true}) {
    for (const bool to_front : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "reverse " << reverse << ", to_front " << to_front);
      Twin one(false);
      Twin batch(false);
      for (Twin* t : {&one, &batch}) {
        std::vector<SeqId> displaced;
        std::vector<BlockId> b(8);
        t->wm->AcquireN(8, kDefaultPriority, 0, b.data(), &displaced);
        t->wm->Link(b[2], t->n1);  // cached: its own queue
        t->wm->Claim(b[4]);        // two holders: stays referenced
        t->wm->Release(b[6]);      // already free before the batch
      }
      const std::vector<BlockId> blocks{0, 1, 2, 3, 4, 5};
      if (reverse) {
        for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) one.wm->Release(*it, to_front);
      } else {
        for (const BlockId b : blocks) one.wm->Release(b, to_front);
      }
      batch.wm->ReleaseN(blocks.data(), static_cast<std::int32_t>(blocks.size()), reverse, to_front);
      EXPECT_EQ(batch.FreeOrder(), one.FreeOrder());
      for (BlockId b = 0; b < kBlocks; ++b) EXPECT_EQ(batch.wm->RefCount(b), one.wm->RefCount(b)) << "block " << b;
      EXPECT_EQ(batch.wm->RefCount(4), 1);
      EXPECT_EQ(batch.wm->policy().NumScratch(CacheLevel::kPrimary), one.wm->policy().NumScratch(CacheLevel::kPrimary));
      std::vector<std::int32_t> refs(kBlocks, 0);
      refs[4] = 1;
      refs[7] = 1;
      batch.wm->CheckInvariants(refs);
    }
  }
  // The exact order for one case: released 5, 3, 1, 0 (reverse) to the back after 8..11 and 6;
  // block 2 is cached (after every scratch block), block 4 is still held.
  Twin t(false);
  std::vector<SeqId> displaced;
  std::vector<BlockId> b(8);
  t.wm->AcquireN(8, kDefaultPriority, 0, b.data(), &displaced);
  t.wm->Link(b[2], t.n1);
  t.wm->Claim(b[4]);
  t.wm->Release(b[6]);
  const std::vector<BlockId> blocks{0, 1, 2, 3, 4, 5};
  t.wm->ReleaseN(blocks.data(), 6, /*reverse=*/true);
  EXPECT_EQ(t.FreeOrder(), (std::vector<BlockId>{8, 9, 10, 11, 6, 5, 3, 1, 0, 2}));
}

TEST(WindowBlockManagerTest, SeveralReleasersOfOneBlockAreKeptForgottenAndDisplaced) {
  Twin t(true);
  std::vector<SeqId> displaced;
  std::vector<BlockId> b(1);
  t.wm->AcquireN(1, kDefaultPriority, 0, b.data(), &displaced);
  for (int i = 0; i < 4; ++i) t.wm->Claim(b[0]);  // five sequences share it
  EXPECT_FALSE(t.wm->HasReleasers(b[0]));
  for (const SeqId id : {5, 6, 7}) t.wm->Release(b[0], false, /*released_by=*/id);
  EXPECT_TRUE(t.wm->HasReleasers(b[0]));
  EXPECT_EQ(t.wm->Releasers(b[0]), (std::vector<SeqId>{5, 6, 7}));
  t.wm->ForgetRelease(b[0], 5);  // the first: a later one takes its place
  EXPECT_EQ(t.wm->Releasers(b[0]), (std::vector<SeqId>{7, 6}));
  t.wm->ForgetRelease(b[0], 6);
  EXPECT_EQ(t.wm->Releasers(b[0]), (std::vector<SeqId>{7}));
  EXPECT_THROW(t.wm->ForgetRelease(b[0], 6), InternalError);  // no record left
  t.wm->Release(b[0], false, /*released_by=*/8);
  t.wm->Release(b[0], false, /*released_by=*/9);  // free now, with releasers 7, 8 and 9
  EXPECT_EQ(t.wm->RefCount(b[0]), 0);
  std::vector<BlockId> taken(kBlocks);
  t.wm->AcquireN(kBlocks, kDefaultPriority, 0, taken.data(), &displaced);
  EXPECT_EQ(displaced, (std::vector<SeqId>{7, 8, 9}));  // handed out again: their records are stale
  EXPECT_FALSE(t.wm->HasReleasers(b[0]));
  EXPECT_TRUE(t.wm->Releasers(b[0]).empty());
}

TEST(WindowBlockManagerTest, EvictionKeysOrderQueuedBlocksAndStampLaterReleasesLater) {
  Twin t(false);
  t.Prepare();  // free cached blocks: 5 (priority 10), then 1 and 2 (default priority), queued in that order
  std::uint64_t clock = 0;
  t.wm->EnableEvictionKeys(&clock);
  // Blocks queued before the keys were enabled are stamped in hand-out order (after the
  // scratch blocks, whose key is always {-1, 0}).
  const std::vector<BlockId> order = t.FreeOrder();
  ASSERT_EQ(order.size(), 9u);
  EXPECT_EQ(std::vector<BlockId>(order.end() - 3, order.end()), (std::vector<BlockId>{5, 1, 2}));
  EXPECT_EQ(clock, 9u);
  const auto k5 = t.wm->EvictionKeyOf(5);
  const auto k1 = t.wm->EvictionKeyOf(1);
  const auto k2 = t.wm->EvictionKeyOf(2);
  EXPECT_EQ(t.wm->EvictionKeyOf(order[0]).rank, -1);
  EXPECT_EQ(t.wm->EvictionKeyOf(order[0]).stamp, 0u);
  EXPECT_EQ(k5.rank, 2 * 10);
  EXPECT_EQ(k1.rank, 2 * kDefaultPriority);
  EXPECT_EQ(k2.rank, 2 * kDefaultPriority);
  EXPECT_EQ(k5.stamp, 7u);
  EXPECT_EQ(k1.stamp, 8u);
  EXPECT_EQ(k2.stamp, 9u);
  EXPECT_TRUE(k5 < k1 && k1 < k2);
  // A block queued again goes to the back of its queue, and its key after every other.
  t.wm->Claim(1);
  t.wm->Release(1);
  EXPECT_EQ(t.wm->EvictionKeyOf(1).stamp, 10u);
  EXPECT_TRUE(k2 < t.wm->EvictionKeyOf(1));
  EXPECT_EQ(t.FreeOrder().back(), 1);
}

TEST(WindowBlockManagerTest, ReleaseNOfAFreeBlockIsAnInternalError) {
  Twin t(false);
  std::vector<SeqId> displaced;
  std::vector<BlockId> b(2);
  t.wm->AcquireN(2, kDefaultPriority, 0, b.data(), &displaced);
  t.wm->Release(b[1]);
  EXPECT_THROW(t.wm->ReleaseN(b.data(), 2, false), InternalError);
  // The block before the bad one was released and queued.
  EXPECT_EQ(t.wm->RefCount(b[0]), 0);
  EXPECT_TRUE(t.wm->policy().Contains(b[0]));
  t.wm->CheckInvariants(std::vector<std::int32_t>(kBlocks, 0));
}

}  // namespace
}  // namespace kvcache
