// SlabLender on its own, over real windows: which lender Make picks, the answers without
// lending (each window's own blocks, nothing moves), and a lending plan: borrowing, kept
// blocks, the moves, the releasers of lent blocks it reports, and a failed plan moving nothing.
#include "kvcache/slab_lender.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcache/kv_cache_manager.h"
#include "kvcache/memory_backend.h"
#include "kvcache/reuse_tree.h"
#include "kvcache/window_block_manager.h"

namespace kvcache {
namespace {

PoolLayout OnePool() {
  PoolLayout pool;
  pool.num_kv_heads = 1;
  pool.layers = {0};
  pool.tokens_per_block = 4;
  pool.head_dim = 8;
  pool.elem_bytes = 2;
  return pool;
}

ManagerConfig Config(bool lend, std::int32_t primary4, std::int32_t primary16) {
  ManagerConfig c;
  c.lend_free_memory = lend;
  c.blocks_per_window = {{4, WindowBlocks{primary4, 0}}, {16, WindowBlocks{primary16, 0}}};
  return c;
}

// Windows {4 (sliding), 16} of one pool each, the same block size: a slab is one block of each.
struct Windows {
  std::unique_ptr<MemoryBackend> backend = MakeVirtualBackend();
  ReuseTree tree{2};
  std::unique_ptr<SlabLender> lender;  // before windows: its arena outlives them
  SlabLender::Windows windows;

  Windows(bool lend, std::int32_t primary4, std::int32_t primary16) {
    const std::vector<std::vector<PoolLayout>> pools{{OnePool()}, {OnePool()}};
    lender = SlabLender::Make(Config(lend, primary4, primary16), {4, 16}, pools, backend.get(), windows);
    const std::vector<std::int32_t> own{primary4, primary16};
    for (std::size_t w = 0; w < 2; ++w) {
      const WindowPrimary p = lender->Primary(w, own[w]);
      windows.push_back(std::make_unique<WindowBlockManager>(w == 0 ? 4 : 16, w == 0, static_cast<std::int32_t>(w),
                                                             pools[w], p.num_primary, 0, backend.get(), &tree,
                                                             WindowReuseOptions{}, nullptr, p.shared));
    }
    lender->Start();
  }
  std::size_t Index(WindowSize window) const { return window == 4 ? 0 : 1; }
};

TEST(SlabLenderTest, WithoutLendingEveryAnswerIsTheWindowsOwn) {
  Windows s(/*lend=*/false, 2, 6);
  SlabLender& l = *s.lender;
  EXPECT_FALSE(l.lends());
  EXPECT_EQ(l.Primary(0, 2).num_primary, 2);
  EXPECT_EQ(l.Primary(0, 2).shared, nullptr);
  EXPECT_EQ(l.PlanBlocks({3, 1}, {2, 6}), 0);   // window 4 is short: nothing to borrow from
  EXPECT_EQ(l.PlanBlocks({1, 7}, {2, 6}), 1);
  EXPECT_EQ(l.PlanBlocks({2, 6}, {2, 6}), -1);
  EXPECT_TRUE(l.MoveSlabs().empty());
  EXPECT_TRUE(l.Rebalance().empty());
  EXPECT_TRUE(l.ServesStep({2, 6}, {2, 6}));
  EXPECT_FALSE(l.ServesStep({3, 0}, {2, 6}));
  const auto index = [&s](WindowSize w) { return s.Index(w); };
  EXPECT_TRUE(l.FitsWhenEmpty({{4, 2}, {16, 6}}, index));
  EXPECT_FALSE(l.FitsWhenEmpty({{4, 3}}, index));
  EXPECT_EQ(l.FreeBlocks(0), 2);
  EXPECT_EQ(l.FreeBlocks(1), 6);
  EXPECT_EQ(l.LendNote(0), "");
  EXPECT_EQ(l.lent_slabs(), 0);
  EXPECT_EQ(l.arena_bytes(), 0u);
  EXPECT_EQ(s.windows[0]->NumOwnedPrimary(), 2);
  l.CheckInvariants();
}

TEST(SlabLenderTest, ASingleWindowLendsNothing) {
  auto backend = MakeVirtualBackend();
  ManagerConfig c;
  c.lend_free_memory = true;
  c.blocks_per_window = {{16, WindowBlocks{4, 0}}};
  SlabLender::Windows none;
  EXPECT_FALSE(SlabLender::Make(c, {16}, {{OnePool()}}, backend.get(), none)->lends());
}

TEST(SlabLenderTest, AShortWindowBorrowsWhollyFreeSlabsAvoidingKeptBlocks) {
  Windows s(/*lend=*/true, 2, 6);  // window 4 owns slabs 0-1, window 16 slabs 2-7
  SlabLender& l = *s.lender;
  EXPECT_TRUE(l.lends());
  EXPECT_EQ(l.Primary(0, 2).num_primary, 8);  // block ids span the arena
  EXPECT_EQ(s.windows[0]->NumOwnedPrimary(), 2);
  EXPECT_EQ(l.FreeBlocks(0), 2 + 6);
  EXPECT_NE(l.LendNote(0).find("counting 6 that the other windows"), std::string::npos) << l.LendNote(0);
  const auto index = [&s](WindowSize w) { return s.Index(w); };
  EXPECT_TRUE(l.FitsWhenEmpty({{4, 5}, {16, 3}}, index));  // 8 slabs in all
  EXPECT_FALSE(l.FitsWhenEmpty({{4, 5}, {16, 4}}, index));

  // Window 4 needs 3 with 2 free: one slab, the next victim of window 16 (slab 2).
  ASSERT_EQ(l.PlanBlocks({3, 0}, {2, 6}), -1);
  EXPECT_TRUE(l.MoveSlabs().empty());
  EXPECT_TRUE(s.windows[0]->OwnsSlab(2));
  EXPECT_EQ(s.windows[0]->NumOwnedPrimary(), 3);
  EXPECT_EQ(l.lent_slabs(), 1);
  l.CheckInvariants();

  // One more, keeping window 16's block 3 (its next victim now): another slab moves.
  const std::int32_t front[2] = {0, 0};
  const BlockId partial[2] = {kNullBlock, 3};
  const KeptBlocks kept{&s.tree, nullptr, 0, front, partial};
  ASSERT_EQ(l.PlanBlocks({4, 0}, {3, 5}, &kept), -1);
  EXPECT_TRUE(l.MoveSlabs().empty());
  EXPECT_TRUE(s.windows[1]->OwnsSlab(3));
  EXPECT_EQ(s.windows[0]->NumOwnedPrimary(), 4);
  EXPECT_EQ(l.lent_slabs(), 2);
  l.CheckInvariants();

  // A plan that fails leaves nothing to move.
  EXPECT_EQ(l.PlanBlocks({9, 0}, {4, 4}), 0);
  EXPECT_TRUE(l.MoveSlabs().empty());
  EXPECT_EQ(l.lent_slabs(), 2);
  l.CheckInvariants();
}

TEST(SlabLenderTest, MovingASlabReportsTheReleasersOfItsBlocks) {
  Windows s(/*lend=*/true, 2, 6);
  SlabLender& l = *s.lender;
  WindowBlockManager& full = *s.windows[1];
  std::vector<SeqId> displaced;
  std::vector<BlockId> held(6);
  full.AcquireN(6, kDefaultPriority, 0, held.data(), &displaced);
  full.Release(held[2], /*to_front=*/false, /*released_by=*/7);  // 7 keeps a record of it
  ASSERT_EQ(l.PlanBlocks({3, 0}, {2, 1}), -1);  // the only wholly free slab of window 16
  EXPECT_EQ(l.MoveSlabs(), std::vector<SeqId>{7});
  EXPECT_TRUE(s.windows[0]->OwnsSlab(held[2]));
  EXPECT_FALSE(full.HasReleasers(held[2]));
}

}  // namespace
}  // namespace kvcache
