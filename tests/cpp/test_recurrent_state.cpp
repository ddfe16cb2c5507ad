// The recurrent-state kind: state groups and slots, working states (zeroed, restored from a
// checkpoint, copied by a fork), checkpoints (taken where a prefill chunk ends, stored with the
// chain, evicted by LRU, capped per path), the hybrid hit search and its lost-hit counters.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

constexpr std::int32_t kTpb = 4;

/// One full-attention layer (window 64) and one recurrent layer with a (2, 3) float32 state.
ModelSpec Hybrid() {
  ModelSpec m = Model(1);
  m.recurrent_layers = {{StateTensorSpec{{2, 3}, DType::kFloat32}}};
  return m;
}

ManagerConfig HybridConfig(std::int32_t slots, std::int32_t max_batch = 2, std::vector<std::int32_t> windows = {0}) {
  std::map<WindowSize, std::int32_t> blocks;
  for (std::int32_t w : windows) blocks[w <= 0 ? 64 : w] = 64;
  ManagerConfig c = Config(std::move(windows), 64, blocks, kTpb);
  c.max_batch_size = max_batch;
  c.enable_block_reuse = true;
  c.state_slots = slots;
  return c;
}

/// The six floats of slot `s` (layer 0, tensor 0).
std::vector<float> ReadSlot(const KVCacheManager& m, SlotId s) {
  const StateView v = m.GetStateView(0, 0);
  std::vector<float> out(6);
  std::memcpy(out.data(), static_cast<const unsigned char*>(v.data) + static_cast<std::size_t>(s) * 24, 24);
  return out;
}

void WriteSlot(const KVCacheManager& m, SlotId s, float value) {
  const StateView v = m.GetStateView(0, 0);
  std::vector<float> in(6, value);
  std::memcpy(static_cast<unsigned char*>(v.data) + static_cast<std::size_t>(s) * 24, in.data(), 24);
}

/// The engine's side of a step: the checkpoint copies after the forward pass.
void CopyCheckpoints(KVCacheManager& m) {
  std::vector<StateCopy> after;
  m.TakeStateCopies(&after);
  for (const StateCopy& c : after) {
    const std::vector<float> src = ReadSlot(m, c.src);
    WriteSlot(m, c.dst, src[0]);
  }
}

std::int32_t Add(KVCacheManager& m, SeqId id, const std::vector<TokenId>& t, std::optional<std::int32_t> prefill) {
  return m.AddSequence(id, t.data(), t.size(), {}, prefill);
}

TEST(StateGroups, LayersWithEqualTensorsShareAGroup) {
  const StateTensorSpec conv{{8, 3}, DType::kBFloat16};
  const StateTensorSpec ssm{{2, 4, 4}, DType::kFloat32};
  const std::vector<StateGroupLayout> g = PlanStateGroups({{conv, ssm}, {conv}, {conv, ssm}});
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].layers, (std::vector<std::int32_t>{0, 2}));
  EXPECT_EQ(g[0].tensor_offsets, (std::vector<std::size_t>{0, 48}));
  EXPECT_EQ(g[0].layer_bytes, 48u + 128u);
  EXPECT_EQ(g[0].slot_bytes, 2u * 176u);
  EXPECT_EQ(g[1].layers, (std::vector<std::int32_t>{1}));
  EXPECT_EQ(g[1].slot_bytes, 48u);
  EXPECT_THROW(PlanStateGroups({{StateTensorSpec{{0, 3}, DType::kFloat32}}}), std::invalid_argument);
  EXPECT_THROW(PlanStateGroups({{}}), std::invalid_argument);
}

TEST(StateGroups, ConfigurationErrors) {
  ManagerConfig c = HybridConfig(2, 2);
  EXPECT_THROW(KVCacheManager(Hybrid(), c), std::invalid_argument);  // slots <= max_batch_size
  c = HybridConfig(4, 0);
  EXPECT_THROW(KVCacheManager(Hybrid(), c), std::invalid_argument);  // no max_batch_size
  c = HybridConfig(4, 2);
  c.shared_cache_url = "redis://127.0.0.1:1";
  EXPECT_THROW(KVCacheManager(Hybrid(), c), std::invalid_argument);
}

TEST(StateSlots, WorkingSlotIsZeroedAndViewed) {
  KVCacheManager m(Hybrid(), HybridConfig(4));
  const StateView v = m.GetStateView(0, 0);
  EXPECT_EQ(v.shape, (std::vector<std::int64_t>{4, 2, 3}));
  EXPECT_EQ(v.strides, (std::vector<std::int64_t>{24, 12, 4}));
  WriteSlot(m, 0, 7.0f);
  Add(m, 1, Iota(6), std::nullopt);
  EXPECT_EQ(m.GetStateSlot(1, 0), 0);
  EXPECT_EQ(ReadSlot(m, 0), std::vector<float>(6, 0.0f));
  EXPECT_EQ(m.GetStats().working_state_slots, 1);
  m.RemoveSequence(1);
  EXPECT_EQ(m.GetStats().working_state_slots, 0);
  EXPECT_THROW(m.GetStateView(1, 0), std::invalid_argument);
  EXPECT_THROW(m.GetStateView(0, 1), std::invalid_argument);
  m.CheckInvariants();
}

TEST(Checkpoints, PromptEndIsStoredAndRestored) {
  KVCacheManager m(Hybrid(), HybridConfig(6));
  const std::vector<TokenId> a = Iota(13);
  const PreparedPrompt pa = m.Prepare(a.data(), a.size(), {});
  // The last boundary before the last token is 12: a whole-prompt chunk would straddle it.
  EXPECT_EQ(m.GetPromptChunkLimit(pa, 13), 12);
  EXPECT_EQ(Add(m, 1, a, 12), 0);
  const SlotId w1 = m.GetStateSlot(1, 0);
  WriteSlot(m, w1, 12.0f);  // the forward pass over [0, 12) ends the state there
  std::vector<StateCopy> after;
  m.TakeStateCopies(&after);
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].group, 0);
  EXPECT_EQ(after[0].src, w1);
  const SlotId checkpoint = after[0].dst;
  WriteSlot(m, checkpoint, 12.0f);
  EXPECT_EQ(m.GetChunkLimit(1, 1), 1);
  m.Prefill(1, 1);
  WriteSlot(m, w1, 13.0f);
  EXPECT_EQ(m.GetStats().pending_checkpoints, 1);
  m.CheckInvariants();
  m.RemoveSequence(1);
  KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.checkpoints_stored, 1);
  EXPECT_EQ(s.cached_checkpoints, 1);
  EXPECT_EQ(s.pending_checkpoints, 0);
  // A prompt sharing the first 12 tokens resumes there, its state copied from the checkpoint.
  std::vector<TokenId> b = Iota(12);
  for (TokenId t : {100, 101, 102, 103, 104}) b.push_back(t);
  const PreparedPrompt pb = m.Prepare(b.data(), b.size(), {});
  const ReusableByKind r = m.GetReusableByKind(pb);
  EXPECT_EQ(r.matched, 12);
  EXPECT_EQ(r.full_attention, 12);
  EXPECT_EQ(r.recurrent_state, 12);
  EXPECT_EQ(m.GetReusablePrefixLength(b.data(), b.size(), {}), 12);
  EXPECT_EQ(Add(m, 2, b, std::nullopt), 12);
  const SlotId w2 = m.GetStateSlot(2, 0);
  EXPECT_NE(w2, checkpoint);
  EXPECT_EQ(ReadSlot(m, w2), std::vector<float>(6, 12.0f));
  s = m.GetStats();
  EXPECT_EQ(s.checkpoints_restored, 1);
  EXPECT_EQ(s.lost_hit_tokens_no_checkpoint, 0);
  m.CheckInvariants();
}

TEST(Checkpoints, StraddledCheckpointIsSkippedAndCounted) {
  KVCacheManager m(Hybrid(), HybridConfig(6));
  CheckpointPolicy none;
  Add(m, 1, Iota(13), std::nullopt);  // one chunk [0, 13) straddles 12
  CopyCheckpoints(m);
  m.RemoveSequence(1);
  const KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.checkpoints_skipped, 1);
  EXPECT_EQ(s.checkpoints_stored, 0);
  // The attention blocks are cached, the state is not: no hit, and the counter says why.
  std::vector<TokenId> b = Iota(13);
  b[12] = 99;
  EXPECT_EQ(Add(m, 2, b, std::nullopt), 0);
  EXPECT_EQ(m.GetStats().lost_hit_tokens_no_checkpoint, 12);
  m.CheckInvariants();
}

TEST(Checkpoints, JunctionMakesTheNextSharerHit) {
  ManagerConfig c = HybridConfig(6);
  c.checkpoint_policy.prompt_end = false;
  c.checkpoint_policy.finish = false;
  KVCacheManager m(Hybrid(), c);
  Add(m, 1, Iota(21), std::nullopt);  // attention blocks only: no policy takes a checkpoint
  m.RemoveSequence(1);
  std::vector<TokenId> b = Iota(8);
  for (TokenId t = 200; t < 213; ++t) b.push_back(t);
  const PreparedPrompt pb = m.Prepare(b.data(), b.size(), {});
  EXPECT_EQ(m.GetReusableByKind(pb).full_attention, 8);
  EXPECT_EQ(m.GetReusableByKind(pb).recurrent_state, 0);
  // The junction is where b leaves the cached prefix: its first chunk ends there.
  EXPECT_EQ(m.GetPromptChunkLimit(pb, 21), 8);
  EXPECT_EQ(Add(m, 2, b, 8), 0);
  WriteSlot(m, m.GetStateSlot(2, 0), 8.0f);
  CopyCheckpoints(m);
  m.Prefill(2, 13);
  m.StoreContextBlocks(2);  // the checkpoint joins the tree with the prompt's blocks
  EXPECT_EQ(m.GetStats().cached_checkpoints, 1);
  std::vector<TokenId> d = Iota(8);
  for (TokenId t = 300; t < 310; ++t) d.push_back(t);
  EXPECT_EQ(Add(m, 3, d, std::nullopt), 8);
  EXPECT_EQ(ReadSlot(m, m.GetStateSlot(3, 0)), std::vector<float>(6, 8.0f));
  m.CheckInvariants();
}

TEST(Checkpoints, IntervalPlansEveryNBlocks) {
  ManagerConfig c = HybridConfig(8);
  c.checkpoint_policy.interval_blocks = 2;
  c.checkpoint_policy.finish = false;
  KVCacheManager m(Hybrid(), c);
  const std::vector<TokenId> a = Iota(30);
  const PreparedPrompt pa = m.Prepare(a.data(), a.size(), {});
  EXPECT_EQ(m.GetPromptChunkLimit(pa, 30), 8);
  Add(m, 1, a, 8);
  EXPECT_EQ(m.GetChunkLimit(1, 30), 8);  // to 16
  m.Prefill(1, 8);
  EXPECT_EQ(m.GetChunkLimit(1, 30), 8);  // to 24
  m.Prefill(1, 8);
  EXPECT_EQ(m.GetChunkLimit(1, 30), 4);  // to 28, the prompt end (last boundary before token 29)
  m.Prefill(1, 4);
  EXPECT_EQ(m.GetChunkLimit(1, 30), 30);
  EXPECT_EQ(m.GetStats().pending_checkpoints, 4);
  CopyCheckpoints(m);
  m.Prefill(1, 2);
  m.RemoveSequence(1);
  EXPECT_EQ(m.GetStats().cached_checkpoints, 4);
  m.CheckInvariants();
}

TEST(Checkpoints, FinishKeepsTheLastBoundaryOfADecode) {
  KVCacheManager m(Hybrid(), HybridConfig(6));
  Add(m, 1, Iota(5), std::nullopt);  // no boundary before the last token but 4: a straddled chunk
  std::vector<TokenId> out = Iota(5);
  for (TokenId t = 50; t < 61; ++t) {  // decode to 16 tokens: boundaries 8, 12, 16
    m.AddToken(1, t);
    out.push_back(t);
    WriteSlot(m, m.GetStateSlot(1, 0), static_cast<float>(out.size()));
    CopyCheckpoints(m);
  }
  EXPECT_EQ(m.GetStats().pending_checkpoints, 1);  // one rolling slot
  m.AddToken(1, 61);
  out.push_back(61);
  m.RemoveSequence(1);
  // The rolling checkpoint holds the state at 16 tokens; a next turn extending the chat resumes there.
  out.push_back(70);
  out.push_back(71);
  EXPECT_EQ(Add(m, 2, out, std::nullopt), 16);
  EXPECT_EQ(ReadSlot(m, m.GetStateSlot(2, 0)), std::vector<float>(6, 16.0f));
  m.CheckInvariants();
}

TEST(Checkpoints, ForkCopiesTheWorkingState) {
  KVCacheManager m(Hybrid(), HybridConfig(6, 3));
  Add(m, 1, Iota(6), std::nullopt);
  WriteSlot(m, m.GetStateSlot(1, 0), 3.5f);
  const SeqId kids[] = {2, 3};
  m.ForkSequence(1, kids, 2);
  EXPECT_NE(m.GetStateSlot(2, 0), m.GetStateSlot(1, 0));
  EXPECT_NE(m.GetStateSlot(3, 0), m.GetStateSlot(2, 0));
  EXPECT_EQ(ReadSlot(m, m.GetStateSlot(2, 0)), std::vector<float>(6, 3.5f));
  EXPECT_EQ(ReadSlot(m, m.GetStateSlot(3, 0)), std::vector<float>(6, 3.5f));
  EXPECT_EQ(m.GetStats().working_state_slots, 3);
  m.CheckInvariants();
}

TEST(Checkpoints, RewindNeedsACheckpointAtTheTarget) {
  KVCacheManager m(Hybrid(), HybridConfig(6));
  Add(m, 1, Iota(6), std::nullopt);
  for (TokenId t = 10; t < 12; ++t) m.AddToken(1, t);  // 8 tokens: the rolling checkpoint
  WriteSlot(m, m.GetStateSlot(1, 0), 8.0f);
  CopyCheckpoints(m);
  m.AddToken(1, 12);
  m.AddToken(1, 13);
  WriteSlot(m, m.GetStateSlot(1, 0), 10.0f);
  EXPECT_THROW(m.Rewind(1, 1), std::invalid_argument);  // no state at 9 tokens
  EXPECT_EQ(m.NumTokens(1), 10);
  m.Rewind(1, 2);
  EXPECT_EQ(m.NumTokens(1), 8);
  EXPECT_EQ(ReadSlot(m, m.GetStateSlot(1, 0)), std::vector<float>(6, 8.0f));
  m.CheckInvariants();
}

TEST(Checkpoints, SlotsForUnregisteredSequencesAreKept) {
  // 3 slots, 2 sequences at most: with one registered, one slot may become a checkpoint, not two.
  ManagerConfig c = HybridConfig(3, 2);
  c.checkpoint_policy.interval_blocks = 1;
  c.checkpoint_policy.finish = false;
  KVCacheManager m(Hybrid(), c);
  Add(m, 1, Iota(13), 4);
  m.Prefill(1, 4);
  KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.pending_checkpoints, 1);
  EXPECT_EQ(s.checkpoints_skipped, 1);
  Add(m, 2, Iota(3, 500), std::nullopt);
  EXPECT_EQ(m.GetStats().free_state_slots, 0);
  m.CheckInvariants();
}

TEST(Checkpoints, LeastRecentlyUsedIsEvictedAndCapPerPath) {
  ManagerConfig c = HybridConfig(4, 1);
  c.checkpoint_policy.finish = false;
  c.checkpoint_policy.interval_blocks = 1;
  c.checkpoint_policy.max_per_path = 2;
  KVCacheManager m(Hybrid(), c);
  Add(m, 1, Iota(13), 4);
  CopyCheckpoints(m);
  m.Prefill(1, 4);
  CopyCheckpoints(m);
  m.Prefill(1, 4);
  CopyCheckpoints(m);
  m.Prefill(1, 1);
  m.RemoveSequence(1);
  // Checkpoints at 4, 8 and 12; the cap keeps the two deepest.
  KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.checkpoints_stored, 3);
  EXPECT_EQ(s.cached_checkpoints, 2);
  EXPECT_EQ(s.checkpoints_evicted, 1);
  std::vector<TokenId> b = Iota(9);
  b.push_back(77);
  const PreparedPrompt pb = m.Prepare(b.data(), b.size(), {});
  EXPECT_EQ(m.GetReusableByKind(pb).recurrent_state, 8);
  EXPECT_TRUE(m.ResetPrefixCache());
  EXPECT_EQ(m.GetStats().cached_checkpoints, 0);
  EXPECT_EQ(m.GetReusableByKind(pb).recurrent_state, 0);
  m.CheckInvariants();
}

TEST(Checkpoints, SlidingWindowMustServeTheShorterPrefix) {
  // Full attention + a sliding window of 4 tokens + the state: a hit at 8 needs the window's
  // block [4, 8), and the state's checkpoint at 8.
  ModelSpec model = Hybrid();
  model.num_layers = 2;
  ManagerConfig c = HybridConfig(6, 2, {4, 0});
  c.checkpoint_policy.finish = false;
  c.checkpoint_policy.interval_blocks = 2;
  KVCacheManager m(model, c);
  Add(m, 1, Iota(13), 8);
  CopyCheckpoints(m);
  m.Prefill(1, 4);
  CopyCheckpoints(m);
  m.Prefill(1, 1);
  m.RemoveSequence(1);
  std::vector<TokenId> b = Iota(12);
  b.push_back(90);
  b.push_back(91);
  const PreparedPrompt pb = m.Prepare(b.data(), b.size(), {});
  const ReusableByKind r = m.GetReusableByKind(pb);
  EXPECT_EQ(r.full_attention, 12);
  EXPECT_EQ(r.recurrent_state, 12);
  EXPECT_EQ(Add(m, 2, b, std::nullopt), 12);
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache

namespace kvcache {
namespace {

TEST(Checkpoints, EvictedCheckpointsMoveToTheHostAndRestoreFromThere) {
  // 3 primary slots for 1 sequence: one working, two for checkpoints; 2 host slots.
  ManagerConfig c = HybridConfig(3, 1);
  c.state_secondary_slots = 2;
  c.checkpoint_policy.finish = false;
  c.event_buffer_max_size = 100;
  KVCacheManager m(Hybrid(), c);
  // Four prompts with distinct first blocks, each leaving its prompt-end checkpoint at 4.
  for (std::int32_t id = 0; id < 4; ++id) {
    const std::vector<TokenId> p = Iota(6, 100 * id);
    Add(m, id, p, 4);
    WriteSlot(m, m.GetStateSlot(id, 0), static_cast<float>(id + 1));
    CopyCheckpoints(m);
    m.Prefill(id, 2);
    m.RemoveSequence(id);
    m.CheckInvariants();
  }
  // Slot 0 is every sequence's working slot; the checkpoints of prompts 0 and 1 took slots 1
  // and 2, and each later one evicted the oldest primary checkpoint to the host (slots 3, 4).
  KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.checkpoints_stored, 4);
  EXPECT_EQ(s.cached_checkpoints, 2);
  EXPECT_EQ(s.host_cached_checkpoints, 2);
  EXPECT_EQ(s.checkpoints_offloaded, 2);
  EXPECT_EQ(s.checkpoints_evicted, 0);
  // Prompt 0's checkpoint is on the host: a hit restores it straight into the working slot.
  std::vector<TokenId> again = Iota(4, 0);
  again.push_back(900);
  again.push_back(901);
  EXPECT_EQ(Add(m, 9, again, std::nullopt), 4);
  EXPECT_EQ(m.GetStateSlot(9, 0), 0);
  EXPECT_EQ(ReadSlot(m, 0), std::vector<float>(6, 1.0f));
  EXPECT_EQ(m.GetStats().checkpoints_onboarded, 1);
  std::int32_t moved = 0;
  for (const KVCacheEvent& e : m.GetLatestEvents(0)) {
    if (e.kind == EventKind::kUpdated && e.state_group == 0) {
      EXPECT_EQ(e.cache_level, std::make_optional(std::make_pair(0, 1)));
      ++moved;
    }
  }
  EXPECT_EQ(moved, 2);
  m.RemoveSequence(9);
  EXPECT_TRUE(m.ResetPrefixCache());
  s = m.GetStats();
  EXPECT_EQ(s.cached_checkpoints + s.host_cached_checkpoints, 0);
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache

namespace kvcache {
namespace {

TEST(Checkpoints, ChunkEndAlignsChunksThatDoNotEndThePrompt) {
  ManagerConfig c = HybridConfig(6);
  c.checkpoint_policy = CheckpointPolicy{};
  c.checkpoint_policy.prompt_end = false;
  c.checkpoint_policy.finish = false;
  c.checkpoint_policy.junction = false;
  c.checkpoint_policy.chunk_end = true;
  KVCacheManager m(Hybrid(), c);
  const std::vector<TokenId> a = Iota(30);
  const PreparedPrompt pa = m.Prepare(a.data(), a.size(), {});
  EXPECT_EQ(m.GetPromptChunkLimit(pa, 10), 8);   // [0, 10) -> [0, 8)
  EXPECT_EQ(m.GetPromptChunkLimit(pa, 30), 30);  // the last chunk is not cut
  EXPECT_EQ(m.GetPromptChunkLimit(pa, 3), 3);    // no boundary inside: unchanged
  Add(m, 1, a, 8);
  EXPECT_EQ(m.GetStats().pending_checkpoints, 1);  // at 8, where the chunk ended
  EXPECT_EQ(m.GetChunkLimit(1, 13), 12);
  m.CheckInvariants();
}

TEST(Checkpoints, CheckpointsThatServedAHitAreEvictedLast) {
  // 4 slots, 1 sequence at a time: the working slot and 3 for checkpoints.
  ManagerConfig c = HybridConfig(4, 1);
  c.checkpoint_policy.finish = false;
  KVCacheManager m(Hybrid(), c);
  auto run = [&](SeqId id, const std::vector<TokenId>& p, std::int32_t first) {
    Add(m, id, p, first);
    CopyCheckpoints(m);
    while (m.NumTokens(id) < static_cast<std::int32_t>(p.size())) {
      m.Prefill(id, m.GetChunkLimit(id, static_cast<std::int32_t>(p.size()) - m.NumTokens(id)));
      CopyCheckpoints(m);
    }
    m.RemoveSequence(id);
  };
  run(0, Iota(9), 8);  // checkpoint at 8 (prompt end), later hit
  std::vector<TokenId> b = Iota(8);
  b.push_back(500);
  EXPECT_EQ(m.GetReusablePrefixLength(b.data(), b.size(), {}), 8);
  run(1, b, 1);  // hits the checkpoint at 8: it served a hit
  EXPECT_EQ(m.GetStats().checkpoints_restored, 1);
  // Three prompts with unique first blocks leave three never-hit checkpoints; the pool keeps
  // three cached, so the two older unique ones are evicted and the hit one stays.
  for (SeqId id = 2; id < 5; ++id) run(id, Iota(9, 1000 * static_cast<TokenId>(id)), 8);
  EXPECT_EQ(m.GetStats().cached_checkpoints, 3);
  EXPECT_EQ(m.GetReusablePrefixLength(b.data(), b.size(), {}), 8);
  m.CheckInvariants();
}

}  // namespace
}  // namespace kvcache
