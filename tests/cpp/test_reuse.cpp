// Block reuse: keys, partial reuse, eviction order and priorities, offload/onboard, events,
// and reuse across windows.
#include <gtest/gtest.h>

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

ManagerConfig ReuseConfig(std::vector<std::int32_t> windows, std::int32_t max_seq_len,
                          std::map<WindowSize, std::int32_t> primary, std::int32_t secondary = 0) {
  ManagerConfig c = Config(std::move(windows), max_seq_len, primary);
  for (auto& kv : c.blocks_per_window) kv.second.secondary = secondary;
  c.enable_block_reuse = true;
  return c;
}

std::int32_t Add(KVCacheManager& m, SeqId id, const std::vector<TokenId>& tokens, SequenceOptions opts = {}) {
  return m.AddSequence(id, tokens.data(), tokens.size(), opts);
}

std::int32_t Reusable(const KVCacheManager& m, const std::vector<TokenId>& tokens, const ReuseExtras& extras = {}) {
  return m.GetReusablePrefixLength(tokens.data(), tokens.size(), extras);
}

TEST(ReuseTest, LastTokenIsNeverStoredAndPartialMatchExtends) {
  KVCacheManager m(Model(1), ReuseConfig({}, 64, {{64, 16}}));
  EXPECT_EQ(Add(m, 1, Iota(9)), 0);
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1, 2}));
  m.RemoveSequence(1);  // stores [0..3] and [4..7]; token 8 is the last one: never stored
  EXPECT_EQ(m.GetStats().num_cached_nodes, 2);
  EXPECT_EQ(Reusable(m, Iota(9)), 8);
  EXPECT_EQ(Reusable(m, Iota(10)), 8);  // [8] is not stored
  EXPECT_EQ(Reusable(m, Iota(1)), 0);   // a 1-token prompt never reuses
  EXPECT_EQ(Reusable(m, Iota(2)), 1);   // partial match of the first block
  EXPECT_EQ(Add(m, 2, Iota(9)), 8);
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{0, 1, 3}));
  m.AddToken(2, 9);  // [0..9]: removal stores [8] as a partial block
  m.RemoveSequence(2);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 3);
  EXPECT_EQ(Add(m, 3, Iota(10)), 9);  // partial match of the third block: taken over
  EXPECT_EQ(m.GetCacheBlockIds(3, 64), (std::vector<BlockId>{0, 1, 3}));
  EXPECT_EQ(m.GetStats().num_cached_nodes, 2);  // the taken-over leaf left the tree
  const RequestStats r = m.GetRequestStats(3);
  EXPECT_EQ(r.reused_tokens, 9);
  EXPECT_EQ(r.reused_blocks, 3);
  EXPECT_EQ(r.missed_blocks, 0);
  EXPECT_EQ(r.new_blocks, 0);
  m.CheckInvariants();
  EXPECT_EQ(Add(m, 4, {0}), 0);
  m.CheckInvariants();
}

TEST(ReuseTest, ReuseOffReturnsZeroAndStoresNothing) {
  ManagerConfig c = ReuseConfig({}, 64, {{64, 8}});
  c.enable_block_reuse = false;
  KVCacheManager m(Model(1), c);
  Add(m, 1, Iota(9));
  m.RemoveSequence(1);
  EXPECT_EQ(Add(m, 2, Iota(9)), 0);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 0);
  EXPECT_EQ(m.GetStats().missed_blocks, 0);
}

TEST(ReuseTest, ExtraKeysSeparateChains) {
  KVCacheManager m(Model(1), ReuseConfig({}, 64, {{64, 32}}));
  const auto prompt = Iota(9);
  SequenceOptions lora1;
  lora1.extras.lora_task_id = 1;
  SequenceOptions salted;
  salted.extras.cache_salt = 0;
  SequenceOptions image;
  image.extras.multimodal = {MultimodalItem{0xabc, 2, 3}};
  Add(m, 1, prompt, lora1);
  Add(m, 2, prompt, salted);
  Add(m, 3, prompt, image);
  Add(m, 4, prompt);
  for (SeqId id = 1; id <= 4; ++id) m.RemoveSequence(id);
  EXPECT_EQ(m.GetStats().num_cached_nodes, 8);  // four independent chains of two blocks
  ReuseExtras e;
  EXPECT_EQ(Reusable(m, prompt, e), 8);  // no LoRA, no salt, no items: chain 4
  e.lora_task_id = 1;
  EXPECT_EQ(Reusable(m, prompt, e), 8);
  e.lora_task_id = 2;
  EXPECT_EQ(Reusable(m, prompt, e), 0);
  e.lora_task_id = 0;  // LoRA 0 is not "no LoRA"
  EXPECT_EQ(Reusable(m, prompt, e), 0);
  e = {};
  e.cache_salt = 0;
  EXPECT_EQ(Reusable(m, prompt, e), 8);
  e.cache_salt = 1;
  EXPECT_EQ(Reusable(m, prompt, e), 0);
  e = {};
  e.multimodal = {MultimodalItem{0xabc, 2, 3}};
  EXPECT_EQ(Reusable(m, prompt, e), 8);
  e.multimodal = {MultimodalItem{0xabd, 2, 3}};
  EXPECT_EQ(Reusable(m, prompt, e), 0);
  // The same item elsewhere: block 0 then holds no item and matches the plain chain, block 1
  // matches nothing (and blocks with items are never matched partially).
  e.multimodal = {MultimodalItem{0xabc, 5, 3}};
  EXPECT_EQ(Reusable(m, prompt, e), 4);
  e.multimodal = {MultimodalItem{0xabc, 4, 3}};
  EXPECT_EQ(Reusable(m, prompt, e), 4);
  m.CheckInvariants();
}

TEST(ReuseTest, CopyOnPartialReuseCopiesExactlyTheFirstTokens) {
  KVCacheManager m(Model(2, {2}, 2), ReuseConfig({}, 64, {{64, 8}}));
  const std::vector<TokenId> a = {0, 1, 2, 3, 4, 5, 6, 7, 100};
  Add(m, 1, a);
  const auto blocks = m.GetCacheBlockIds(1, 64);
  // Mark every (layer, kv, head, token, dim) element of block 1 with a distinct value.
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    const LayerView v = m.GetLayerView(layer);
    auto* base = static_cast<unsigned char*>(v.data) + blocks[1] * v.strides[0];
    for (std::int64_t i = 0; i < v.shape[1] * v.strides[1] / 2; ++i) {
      const auto value = static_cast<std::uint16_t>(1 + layer * 1000 + i);
      std::memcpy(base + 2 * i, &value, 2);
    }
  }
  m.RemoveSequence(1);
  Add(m, 2, a);  // holds block 1 again, so the next partial match must copy it
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{0, 1, 3}));
  const std::vector<TokenId> b = {0, 1, 2, 3, 4, 5, 99, 98, 97};
  EXPECT_EQ(Add(m, 3, b), 6);
  const auto got = m.GetCacheBlockIds(3, 64);
  ASSERT_EQ(got, (std::vector<BlockId>{0, 4, 5}));
  for (std::int32_t layer = 0; layer < 2; ++layer) {
    const LayerView v = m.GetLayerView(layer);
    const auto* src = static_cast<const unsigned char*>(v.data) + blocks[1] * v.strides[0];
    const auto* dst = static_cast<const unsigned char*>(v.data) + got[1] * v.strides[0];
    // [kv, heads, tokens, dim] = [2, 2, 4, 2]: per (kv, head) row, tokens 0-1 copied, 2-3 zero.
    for (int row = 0; row < 4; ++row) {
      for (int t = 0; t < 4; ++t) {
        for (int d = 0; d < 2; ++d) {
          const std::int64_t off = v.strides[2] * row + v.strides[3] * t + v.strides[4] * d;
          std::uint16_t want = 0;
          if (t < 2) std::memcpy(&want, src + off, 2);
          std::uint16_t have = 0;
          std::memcpy(&have, dst + off, 2);
          ASSERT_EQ(have, want) << "layer " << layer << " row " << row << " token " << t;
          if (t < 2) {
            ASSERT_NE(want, 0);
          }
        }
      }
    }
  }
  EXPECT_EQ(m.GetRequestStats(3).reused_tokens, 6);
  m.CheckInvariants();
}

TEST(ReuseTest, NoCopyOnPartialReuseOnlyTakesOverFreeLeaves) {
  ManagerConfig c = ReuseConfig({}, 64, {{64, 8}});
  c.copy_on_partial_reuse = false;
  KVCacheManager m(Model(1), c);
  const std::vector<TokenId> a = {0, 1, 2, 3, 4, 5, 6, 7, 100};
  Add(m, 1, a);
  m.RemoveSequence(1);
  Add(m, 2, a);
  EXPECT_EQ(Reusable(m, {0, 1, 2, 3, 4, 5, 99, 98, 97}), 4);  // block 1 is held: no partial reuse
  m.RemoveSequence(2);
  EXPECT_EQ(Reusable(m, {0, 1, 2, 3, 4, 5, 99, 98, 97}), 6);  // free leaf: taken over
}

// Cached blocks are evicted lowest priority first, oldest release first; blocks holding nothing
// reusable go before any cached block.
TEST(ReuseTest, EvictionOrderFollowsPriorityThenReleaseTime) {
  KVCacheManager m(Model(1), ReuseConfig({}, 64, {{64, 6}}));
  auto with_priority = [](int p) {
    SequenceOptions o;
    o.priority = p;
    return o;
  };
  Add(m, 1, Iota(5, 10), with_priority(50));  // blocks 0 (stored), 1
  m.RemoveSequence(1);
  Add(m, 2, Iota(5, 20), with_priority(20));  // blocks 2 (stored), 3
  m.RemoveSequence(2);
  Add(m, 3, Iota(5, 30));  // blocks 4 (stored, default 35), 5
  m.RemoveSequence(3);
  Add(m, 4, Iota(5, 40), with_priority(20));  // scratch blocks 1 (stored) and 3
  EXPECT_EQ(m.GetCacheBlockIds(4, 64), (std::vector<BlockId>{1, 3}));
  m.RemoveSequence(4);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 6);  // cached blocks count as free
  Add(m, 5, Iota(12, 500));  // 3 blocks: scratch 5, 3, then the oldest priority-20 block (2)
  EXPECT_EQ(m.GetCacheBlockIds(5, 64), (std::vector<BlockId>{5, 3, 2}));
  EXPECT_EQ(Reusable(m, Iota(5, 20)), 0);
  EXPECT_EQ(Reusable(m, Iota(5, 40)), 4);
  Add(m, 6, Iota(12, 600));  // the rest in order: 1 (20), 4 (35), 0 (50)
  EXPECT_EQ(m.GetCacheBlockIds(6, 64), (std::vector<BlockId>{1, 4, 0}));
  EXPECT_EQ(Reusable(m, Iota(5, 10)), 0);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 0);
  m.CheckInvariants();
}

// Segmented LRU: a prefix that served a hit outlives a stream of prompts seen once; plain LRU
// (protect_hit_blocks off) lets the stream flush it.
TEST(ReuseTest, HitPrefixOutlivesPromptsSeenOnce) {
  for (const bool protect : {true, false}) {
    SCOPED_TRACE(protect ? "segmented LRU" : "plain LRU");
    ManagerConfig c = ReuseConfig({}, 64, {{64, 10}});
    c.protect_hit_blocks = protect;
    c.protected_fraction = 0.5;  // 5 of the 10 blocks
    KVCacheManager m(Model(1), c);
    const auto shared = Iota(9, 1000);
    Add(m, 1, shared);  // blocks 0, 1 stored; 2 (one token) goes back to the scratch queue
    m.RemoveSequence(1);
    EXPECT_EQ(Add(m, 2, shared), 8);  // a hit on 0, 1; the next scratch block for the last token
    EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{0, 1, 3}));
    m.RemoveSequence(2);
    for (SeqId id = 3; id < 8; ++id) {  // five prompts seen once, 2 stored blocks each
      Add(m, id, Iota(9, static_cast<TokenId>(100 * id)));
      m.RemoveSequence(id);
      m.CheckInvariants();
    }
    EXPECT_EQ(Reusable(m, shared), protect ? 8 : 0);
    if (protect) {
      // Free order: scratch, then the one-off prompts' blocks (oldest first), the hit prefix
      // last (1 before 0: a sequence releases its newest block first); an allocation of all
      // ten blocks takes it only at the very end.
      Add(m, 8, Iota(40, 5000));
      const auto ids = m.GetCacheBlockIds(8, 64);
      EXPECT_EQ(ids.size(), 10u);
      EXPECT_EQ(std::vector<BlockId>(ids.end() - 2, ids.end()), (std::vector<BlockId>{1, 0}));
    }
    m.CheckInvariants();
  }
}

TEST(ReuseTest, TimedPriorityDecaysAtRefresh) {
  KVCacheManager m(Model(1), ReuseConfig({}, 64, {{64, 4}}));
  m.SetFakeTimeMs(1000);
  SequenceOptions timed;
  timed.priority_ranges = {PriorityRange{0, -1, 80, 10}};
  SequenceOptions fifty;
  fifty.priority = 50;
  Add(m, 1, Iota(5, 10), timed);  // block 0 cached at 80 until t = 1010
  m.RemoveSequence(1);
  Add(m, 2, Iota(5, 20));         // blocks 2, 3 (scratch first); 2 cached at 35
  m.RemoveSequence(2);
  Add(m, 3, Iota(5, 30), fifty);  // blocks 1, 3; 1 cached at 50
  m.RemoveSequence(3);
  m.SetFakeTimeMs(1005);
  m.RefreshBlocks();
  Add(m, 4, Iota(8, 700));  // scratch 3, then priority 35 (block 2); block 0 (80) survives
  EXPECT_EQ(m.GetCacheBlockIds(4, 64), (std::vector<BlockId>{3, 2}));
  m.RemoveSequence(4);  // stores both (the second partially): priority-35 queue [2, 3]
  EXPECT_EQ(Reusable(m, Iota(5, 10)), 4);
  m.SetFakeTimeMs(1011);
  m.RefreshBlocks();  // block 0 returns to 35, at the back: now evicted before block 1 (50)
  Add(m, 5, Iota(12, 800));
  EXPECT_EQ(m.GetCacheBlockIds(5, 64), (std::vector<BlockId>{2, 3, 0}));
  EXPECT_EQ(Reusable(m, Iota(5, 10)), 0);
  EXPECT_EQ(Reusable(m, Iota(5, 30)), 4);
  m.CheckInvariants();
}

TEST(ReuseTest, OffloadAtEvictionThenOnboardKeepsBytes) {
  KVCacheManager m(Model(1, {1}, 2), ReuseConfig({}, 64, {{64, 4}}, /*secondary=*/2));
  const auto a = Iota(9);
  Add(m, 1, a);  // blocks 0, 1, 2
  const LayerView v = m.GetLayerView(0);
  auto* base = static_cast<unsigned char*>(v.data);
  std::memset(base + 0 * v.strides[0], 0x11, static_cast<std::size_t>(v.strides[0]));
  std::memset(base + 1 * v.strides[0], 0x22, static_cast<std::size_t>(v.strides[0]));
  m.RemoveSequence(1);      // cached: 0 and 1 (queued 1, 0: newest released first)
  Add(m, 2, Iota(12, 50));  // 3, 2 (scratch) then 1: offloaded to secondary block 4
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{3, 2, 1}));
  EXPECT_EQ(m.GetStats().offloaded_blocks, 1);
  std::memset(base + 1 * v.strides[0], 0x77, static_cast<std::size_t>(v.strides[0]));  // reused by 2
  EXPECT_EQ(Reusable(m, a), 8);  // still whole: one block lives in host memory
  m.RemoveSequence(2, /*store_for_reuse=*/false);
  EXPECT_EQ(Add(m, 3, a), 8);
  const auto got = m.GetCacheBlockIds(3, 64);
  EXPECT_EQ(m.GetStats().onboarded_blocks, 1);
  for (std::int64_t i = 0; i < v.strides[0]; ++i) {
    ASSERT_EQ(base[got[0] * v.strides[0] + i], 0x11);
    ASSERT_EQ(base[got[1] * v.strides[0] + i], 0x22);
  }
  m.CheckInvariants();
}

TEST(ReuseTest, LowPriorityBlocksAreDroppedNotOffloaded) {
  KVCacheManager m(Model(1), ReuseConfig({}, 64, {{64, 3}}, /*secondary=*/2));
  SequenceOptions low;
  low.priority = 10;  // below secondary_offload_min_priority (30)
  Add(m, 1, Iota(5), low);
  m.RemoveSequence(1);
  Add(m, 2, Iota(12, 50));
  EXPECT_EQ(m.GetStats().offloaded_blocks, 0);
  EXPECT_EQ(Reusable(m, Iota(5)), 0);
  m.CheckInvariants();
}

TEST(ReuseTest, EventStream) {
  ManagerConfig c = ReuseConfig({}, 64, {{64, 4}}, /*secondary=*/1);
  c.event_buffer_max_size = 64;
  KVCacheManager m(Model(1), c);
  auto events = m.GetLatestEvents(0);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, EventKind::kCreated);
  EXPECT_EQ(events[0].window_size, 64);
  EXPECT_EQ(events[0].num_primary_blocks, 4);
  EXPECT_EQ(events[0].num_secondary_blocks, 1);
  SequenceOptions lora;
  lora.extras.lora_task_id = 42;
  Add(m, 1, Iota(9), lora);
  m.RemoveSequence(1);
  events = m.GetLatestEvents(0);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].event_id, 1u);
  EXPECT_EQ(events[0].kind, EventKind::kStored);
  EXPECT_FALSE(events[0].parent_hash.has_value());
  ASSERT_EQ(events[0].blocks.size(), 2u);
  EXPECT_EQ(events[0].blocks[0].tokens, Iota(4));
  EXPECT_EQ(events[0].blocks[1].tokens, Iota(4, 4));
  EXPECT_EQ(events[0].blocks[1].lora_task_id, 42);
  EXPECT_EQ(events[0].blocks[0].cache_level, 0);
  EXPECT_EQ(events[0].blocks[0].priority, kDefaultPriority);
  const std::uint64_t h0 = events[0].blocks[0].hash;
  const std::uint64_t h1 = events[0].blocks[1].hash;
  // Storing the same chain again stores nothing new.
  Add(m, 2, Iota(9), lora);
  m.AddToken(2, 9);
  m.RemoveSequence(2);  // only the new partial block [8]
  events = m.GetLatestEvents(0);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].parent_hash, h1);
  ASSERT_EQ(events[0].blocks.size(), 1u);
  EXPECT_EQ(events[0].blocks[0].tokens, (std::vector<TokenId>{8}));
  const std::uint64_t h2 = events[0].blocks[0].hash;
  // Free: scratch [2], cached [3 ([8]), 1, 0]; one host block (4). Four blocks: 2, then each
  // cached block is offloaded to the host block, whose previous content is dropped first.
  Add(m, 3, Iota(13, 300));
  EXPECT_EQ(m.GetCacheBlockIds(3, 64), (std::vector<BlockId>{2, 3, 1, 0}));
  events = m.GetLatestEvents(0);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].kind, EventKind::kUpdated);
  EXPECT_EQ(events[0].hash, h2);
  EXPECT_EQ(events[0].cache_level, std::make_pair(0, 1));
  EXPECT_FALSE(events[0].priority.has_value());
  EXPECT_EQ(events[1].kind, EventKind::kRemoved);
  EXPECT_EQ(events[1].hashes, (std::vector<std::uint64_t>{h2}));
  EXPECT_EQ(events[2].kind, EventKind::kUpdated);
  EXPECT_EQ(events[2].hash, h1);
  EXPECT_EQ(events[3].kind, EventKind::kRemoved);
  EXPECT_EQ(events[3].hashes, (std::vector<std::uint64_t>{h1}));
  EXPECT_EQ(events[4].kind, EventKind::kUpdated);
  EXPECT_EQ(events[4].hash, h0);
  EXPECT_EQ(events[4].event_id, 7u);
  EXPECT_EQ(m.GetStats().offloaded_blocks, 3);
  m.CheckInvariants();
}

TEST(ReuseTest, RemovalsOfOneWindowAreMerged) {
  ManagerConfig c = ReuseConfig({}, 64, {{64, 4}});
  c.event_buffer_max_size = 8;
  KVCacheManager m(Model(1), c);
  SequenceOptions ranges;  // the first block is the least valuable
  ranges.priority_ranges = {PriorityRange{0, 4, 10, 0}, PriorityRange{4, -1, 50, 0}};
  Add(m, 1, Iota(9), ranges);
  m.RemoveSequence(1);
  auto events = m.GetLatestEvents(0);
  ASSERT_EQ(events.size(), 2u);
  ASSERT_EQ(events[1].blocks.size(), 2u);
  EXPECT_EQ(events[1].blocks[0].priority, 10);
  EXPECT_EQ(events[1].blocks[1].priority, 50);
  const std::uint64_t h0 = events[1].blocks[0].hash;
  const std::uint64_t h1 = events[1].blocks[1].hash;
  Add(m, 2, Iota(9, 100));  // 3, 2, then block 0: its child goes with it
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{3, 2, 0}));
  events = m.GetLatestEvents(0);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, EventKind::kRemoved);
  EXPECT_EQ(events[0].hashes, (std::vector<std::uint64_t>{h0, h1}));
  EXPECT_EQ(m.GetStats().num_cached_nodes, 0);
  m.CheckInvariants();
}

TEST(ReuseTest, EventBufferDropsOldest) {
  ManagerConfig c = ReuseConfig({8, 0}, 64, {{8, 4}, {64, 4}});
  c.event_buffer_max_size = 1;
  KVCacheManager m(Model(2), c);
  auto events = m.GetLatestEvents(0);
  ASSERT_EQ(events.size(), 1u);  // the first window's Created event was dropped
  EXPECT_EQ(events[0].event_id, 1u);
  EXPECT_EQ(events[0].window_size, 64);
  EXPECT_TRUE(m.GetLatestEvents(0).empty());
}

// One window lost a block of the chain: the reused length is what every window can serve.
TEST(ReuseTest, ReusedLengthIsTheMinimumOverWindows) {
  KVCacheManager m(Model(2), ReuseConfig({16, 0}, 64, {{16, 4}, {64, 12}}));
  const auto a = Iota(13);
  Add(m, 1, a);
  m.RemoveSequence(1);  // positions 0..2 stored in both windows
  EXPECT_EQ(Reusable(m, a), 12);
  Add(m, 2, Iota(5, 100));  // window 16: scratch 3, then evicts position 2 (block 2)
  EXPECT_EQ(m.GetCacheBlockIds(2, 16), (std::vector<BlockId>{3, 2}));
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{4, 5}));
  EXPECT_EQ(Reusable(m, a), 8);
  m.RemoveSequence(2);
  EXPECT_EQ(Add(m, 3, a), 8);
  EXPECT_EQ(m.GetCacheBlockIds(3, 16), (std::vector<BlockId>{0, 1, 2, 3}));
  const auto full = m.GetCacheBlockIds(3, 64);
  EXPECT_EQ(full[0], 0);
  EXPECT_EQ(full[1], 1);
  EXPECT_NE(full[2], 2);  // position 2 is recomputed in every window
  m.CheckInvariants();
}

TEST(ReuseTest, PinnedBlocksSurviveEvictionUntilUnpinned) {
  KVCacheManager m(Model(2), ReuseConfig({8, 0}, 64, {{8, 4}, {64, 4}}));
  Add(m, 1, Iota(9));
  m.RemoveSequence(1, /*store_for_reuse=*/true, /*pin=*/true);
  EXPECT_EQ(m.GetNumFreeBlocks(64), 2);  // two stored blocks pinned
  EXPECT_THROW(Add(m, 2, Iota(13, 100)), OutOfBlocksError);
  EXPECT_EQ(Reusable(m, Iota(9)), 8);
  EXPECT_THROW(m.UnpinBlocksById({3}, std::nullopt), std::invalid_argument);  // not stored
  m.CheckInvariants();
  m.UnpinBlocksById({1}, std::nullopt);  // the chain's last block: every window, every ancestor
  EXPECT_EQ(m.GetNumFreeBlocks(64), 4);
  EXPECT_EQ(m.GetNumFreeBlocks(8), 4);
  Add(m, 2, Iota(13, 100));
  EXPECT_EQ(Reusable(m, Iota(9)), 0);
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache

namespace kvcache {
namespace {

ManagerConfig SwaConfig(std::vector<std::int32_t> windows, std::map<WindowSize, std::int32_t> primary,
                        SwaReusePolicy policy) {
  ManagerConfig c = ReuseConfig(std::move(windows), 64, std::move(primary));
  c.swa_reuse_policy = policy;
  return c;
}

// Request 0 releases block 0 of window 8; request 1 acquires it: request 0 may no longer
// publish its chain as if that block still held its data.
TEST(SwaReuseTest, ReclaimedOutOfWindowBlockInvalidatesItsOwner) {
  for (const SwaReusePolicy policy : {SwaReusePolicy::kInvalidate, SwaReusePolicy::kPlaceholder}) {
    SCOPED_TRACE(policy == SwaReusePolicy::kInvalidate ? "invalidate" : "placeholder");
    KVCacheManager m(Model(2), SwaConfig({8, 0}, {{8, 4}, {64, 16}}, policy));
    Add(m, 0, Iota(8));
    for (TokenId t = 8; t < 12; ++t) m.AddToken(0, t);
    EXPECT_EQ(m.GetCacheBlockIds(0, 8), (std::vector<BlockId>{N, 1, 2}));
    EXPECT_TRUE(m.IsSequenceValidForReuse(0));
    Add(m, 1, Iota(5, 100));
    EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{3, 0}));  // block 0 reclaimed
    EXPECT_FALSE(m.IsSequenceValidForReuse(0));
    EXPECT_TRUE(m.IsSequenceValidForReuse(1));
    m.RemoveSequence(1);
    for (TokenId t = 12; t < 16; ++t) m.AddToken(0, t);  // re-acquires block 0 itself
    EXPECT_EQ(m.GetCacheBlockIds(0, 8), (std::vector<BlockId>{N, N, 2, 0}));
    EXPECT_FALSE(m.IsSequenceValidForReuse(0));  // sticky
    const std::int64_t nodes_before = m.GetStats().num_cached_nodes;
    m.RemoveSequence(0);
    m.CheckInvariants();
    if (policy == SwaReusePolicy::kInvalidate) {
      EXPECT_EQ(m.GetStats().num_cached_nodes, nodes_before);  // stored nothing
      EXPECT_EQ(Add(m, 2, Iota(16)), 0);
    } else {
      // Stored: the full-attention chain, and window 8's blocks except the reclaimed one
      // (a placeholder keeps the chain). Window 8 needs tokens [7, 15) only.
      EXPECT_EQ(m.GetStats().num_cached_nodes, nodes_before + 4);
      EXPECT_EQ(Add(m, 2, Iota(16)), 15);
      EXPECT_EQ(m.GetCacheBlockIds(2, 8), (std::vector<BlockId>{N, 1, 2, 0}));
      EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{0, 1, 2, 5}));
    }
    m.CheckInvariants();
  }
}

// Windows {8, 16, full}: a stored prompt longer than both sliding windows loses some sliding
// blocks; the reused length is what every window can still serve from its last window.
TEST(SwaReuseTest, ReuseNeedsOnlyTheLastWindowOfEachSlidingWindow) {
  struct Case {
    SwaReusePolicy policy;
    std::int32_t low_start;  // prompt tokens [low_start, low_start + 8) get priority 10
    std::int32_t low_end;
    std::int32_t want;
  };
  const Case cases[] = {
      {SwaReusePolicy::kPlaceholder, 0, 8, 23},   // window 8 lost positions 0, 1: not needed
      // A sequence releases newest first, so position 1 is older than position 0 and goes first,
      // dropping positions 1..5 of window 8 with it; their blocks, now scratch, go before 0.
      {SwaReusePolicy::kInvalidate, 0, 8, 4},
      {SwaReusePolicy::kPlaceholder, 16, 20, 16}, // window 8 lost position 4: needed past 16
      {SwaReusePolicy::kInvalidate, 16, 20, 16},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "policy " << static_cast<int>(c.policy) << " low [" << c.low_start
                                      << ", " << c.low_end << ")");
    KVCacheManager m(Model(3), SwaConfig({8, 16, 0}, {{8, 8}, {16, 10}, {64, 20}}, c.policy));
    SequenceOptions opts;
    opts.priority_ranges = {PriorityRange{c.low_start, c.low_end, 10, 0}};
    const auto prompt = Iota(24);
    Add(m, 0, prompt, opts);
    m.RemoveSequence(0);  // stores positions 0..5 (the last one partially) in every window
    EXPECT_EQ(Reusable(m, prompt), 23);
    Add(m, 1, Iota(16, 100));  // window 8: 2 scratch blocks, then the low-priority ones
    EXPECT_EQ(Reusable(m, prompt), c.want);
    m.RemoveSequence(1, /*store_for_reuse=*/false);
    EXPECT_EQ(Add(m, 2, prompt), c.want);
    const auto w8 = m.GetCacheBlockIds(2, 8);
    const std::int32_t front = std::max(0, c.want - 8) / 4;
    for (std::int32_t j = 0; j < 6; ++j) EXPECT_EQ(w8[static_cast<std::size_t>(j)] == N, j < front) << j;
    m.CheckInvariants();
  }
}

// Early reuse covers sliding windows: a running request's full prompt blocks serve another.
TEST(SwaReuseTest, StoreContextBlocksCoversSlidingWindows) {
  KVCacheManager m(Model(2), SwaConfig({8, 0}, {{8, 16}, {64, 16}}, SwaReusePolicy::kPlaceholder));
  Add(m, 0, Iota(14));
  EXPECT_EQ(m.StoreContextBlocks(0), 3);  // key of 13 tokens: three full blocks
  EXPECT_EQ(m.StoreContextBlocks(0), 0);  // nothing new
  EXPECT_EQ(Add(m, 1, Iota(14)), 12);
  EXPECT_EQ(m.GetCacheBlockIds(1, 8), (std::vector<BlockId>{N, 1, 2, 4}));
  EXPECT_EQ(m.GetCacheBlockIds(1, 64), (std::vector<BlockId>{0, 1, 2, 4}));
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache

namespace kvcache {
namespace {

// A prompt that fits without reuse fits with it: copying a partial match costs no extra block.
TEST(ReuseTest, PartialCopyNeedsNoExtraFreeBlock) {
  KVCacheManager m(Model(1, {1}, 2), ReuseConfig({}, 64, {{64, 3}}));
  Add(m, 1, {1, 2, 3, 4, 5});
  m.AddToken(1, 6);
  m.RemoveSequence(1);  // [1 2 3 4] -> [5]; the first block is not a leaf: it must be copied
  std::vector<TokenId> prompt = {1, 2, 3};
  prompt.resize(12, 9);
  const auto need = m.GetNumBlocksToAllocate(prompt.data(), prompt.size(), {});
  EXPECT_EQ(need.at(64), 3);
  EXPECT_EQ(Add(m, 2, prompt), 3);
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{2, 1, 0}));
  m.CheckInvariants();
}

TEST(ReuseTest, PartialSourceThatIsTheNextVictimIsTakenOver) {
  KVCacheManager m(Model(1, {1}, 2), ReuseConfig({}, 64, {{64, 2}}));
  SequenceOptions low_first;  // the first block is the least valuable, so evicted first
  low_first.priority_ranges = {PriorityRange{0, 4, 10, 0}, PriorityRange{4, -1, 50, 0}};
  Add(m, 1, {1, 2, 3, 4, 5}, low_first);
  const LayerView v = m.GetLayerView(0);
  auto* base = static_cast<unsigned char*>(v.data);
  std::memset(base, 0x5a, static_cast<std::size_t>(v.strides[0]));  // block 0
  m.AddToken(1, 6);
  m.RemoveSequence(1);
  EXPECT_EQ(Add(m, 2, {1, 2, 3, 9, 9}), 3);
  EXPECT_EQ(m.GetCacheBlockIds(2, 64), (std::vector<BlockId>{0, 1}));
  EXPECT_EQ(base[0], 0x5a);  // the kept tokens are the source's own bytes
  EXPECT_EQ(m.GetStats().num_cached_nodes, 0);
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache
