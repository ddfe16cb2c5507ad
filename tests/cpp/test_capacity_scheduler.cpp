// The native capacity scheduler: exact admissions, chunk sizes, token budgets, pauses and
// rejections on small pools.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "kvcache/capacity_scheduler.h"
#include "kvcache/kv_cache_manager.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

struct Fixture {
  explicit Fixture(std::map<WindowSize, std::int32_t> blocks = {{8, 8}, {64, 8}})
      : manager(Model(2), Config({8, 0}, 64, std::move(blocks), 4, BackendKind::kVirtual)) {}
  KVCacheManager manager;
  std::vector<std::shared_ptr<PreparedPrompt>> prompts;
  std::vector<AdmissionCandidate> Candidates(std::int32_t n, std::int32_t len, std::int32_t final_tokens) {
    std::vector<AdmissionCandidate> out;
    for (std::int32_t i = 0; i < n; ++i) {
      prompts.push_back(std::make_shared<PreparedPrompt>(manager.Prepare(Iota(len, 100 * i), ReuseExtras{})));
      out.push_back(AdmissionCandidate{i, prompts.back().get(), final_tokens});
    }
    return out;
  }
};

CapacitySchedulerConfig Policy(CapacityPolicy p, std::int64_t budget = -1, std::int32_t chunk = -1) {
  CapacitySchedulerConfig c;
  c.policy = p;
  c.max_batch_size = 8;
  c.max_num_batched_tokens = budget;
  c.chunk = chunk >= 0 ? chunk : (budget >= 0 ? static_cast<std::int32_t>(budget) : -1);
  return c;
}

TEST(CapacitySchedulerTest, GuaranteedNoEvictAdmitsWhatEveryWindowHoldsToCompletion) {
  Fixture f;
  const auto candidates = f.Candidates(3, 10, 19);  // 10-token prompts generating 10 tokens
  CapacityScheduler guaranteed(&f.manager, Policy(CapacityPolicy::kGuaranteedNoEvict));
  // Full attention: ceil(19 / 4) = 5 of 8 blocks each, so only one fits to completion.
  StepPlan plan = guaranteed.Schedule(nullptr, nullptr, nullptr, 0, candidates.data(), candidates.size());
  EXPECT_EQ(plan.admitted, (std::vector<std::int32_t>{0}));
  EXPECT_EQ(plan.admitted_chunks, (std::vector<std::int32_t>{10}));
  // max_utilization needs only the prefill: 3 blocks each.
  CapacityScheduler greedy(&f.manager, Policy(CapacityPolicy::kMaxUtilization));
  plan = greedy.Schedule(nullptr, nullptr, nullptr, 0, candidates.data(), candidates.size());
  EXPECT_EQ(plan.admitted, (std::vector<std::int32_t>{0, 1}));
  // A 16-token budget: the first prompt whole, the second's first chunk takes the rest.
  CapacityScheduler budget(&f.manager, Policy(CapacityPolicy::kMaxUtilization, 16));
  plan = budget.Schedule(nullptr, nullptr, nullptr, 0, candidates.data(), candidates.size());
  EXPECT_EQ(plan.admitted, (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(plan.admitted_chunks, (std::vector<std::int32_t>{10, 6}));
  EXPECT_TRUE(plan.paused.empty() && plan.rejected.empty() && plan.generation.empty());
  EXPECT_EQ(f.manager.NumSequences(), 0u);  // deciding registers nothing
}

TEST(CapacitySchedulerTest, GenerationFirstThenContinuingChunksWithinTheBudget) {
  Fixture f({{8, 32}, {64, 32}});
  const auto p = Iota(20);
  f.manager.AddSequence(1, p.data(), p.size());      // decoding
  f.manager.AddSequence(2, p.data(), p.size(), {}, 4);  // 16 prompt tokens to go
  f.manager.AddSequence(3, p.data(), p.size(), {}, 4);
  const SeqId running[] = {1, 2, 3};
  const std::int32_t drafts[] = {2, 0, 0};
  CapacityScheduler s(&f.manager, Policy(CapacityPolicy::kMaxUtilization, 10, 8));
  const StepPlan plan = s.Schedule(running, nullptr, drafts, 3, nullptr, 0);
  EXPECT_EQ(plan.generation, (std::vector<SeqId>{1}));
  EXPECT_EQ(plan.drafts, (std::vector<std::int32_t>{2}));
  // 10 - 3 = 7 tokens left: request 2 gets a 7-token chunk (at most 8), request 3 none.
  EXPECT_EQ(plan.chunks, (std::vector<SeqId>{2}));
  EXPECT_EQ(plan.chunk_sizes, (std::vector<std::int32_t>{7}));
}

TEST(CapacitySchedulerTest, MaxUtilizationPausesTheNewestUntilTheStepFits) {
  Fixture f({{8, 6}, {64, 6}});
  const auto p = Iota(8);
  for (SeqId id = 1; id <= 3; ++id) f.manager.AddSequence(id, p.data(), p.size());  // 2 blocks each
  // Each next token starts a block: 3 new blocks in full attention, which has none free.
  const SeqId running[] = {1, 2, 3};
  CapacityScheduler s(&f.manager, Policy(CapacityPolicy::kMaxUtilization));
  const StepPlan plan = s.Schedule(running, nullptr, nullptr, 3, nullptr, 0);
  // Pausing 3 frees 2 blocks: the other two decode with them.
  EXPECT_EQ(plan.paused, (std::vector<SeqId>{3}));
  EXPECT_EQ(plan.generation, (std::vector<SeqId>{1, 2}));
  EXPECT_FALSE(f.manager.HasSequence(3));
  EXPECT_EQ(f.manager.GetNumFreeBlocks(64), 2);
  f.manager.CheckInvariants();
}

TEST(CapacitySchedulerTest, BatchSizeAndNeverFits) {
  Fixture f;
  const auto candidates = f.Candidates(3, 4, 4);
  CapacitySchedulerConfig c = Policy(CapacityPolicy::kMaxUtilization);
  c.max_batch_size = 2;
  CapacityScheduler s(&f.manager, c);
  const StepPlan plan = s.Schedule(nullptr, nullptr, nullptr, 0, candidates.data(), candidates.size());
  EXPECT_EQ(plan.admitted, (std::vector<std::int32_t>{0, 1}));
  EXPECT_FALSE(s.NeverFits(10, 19));
  EXPECT_TRUE(s.NeverFits(10, 65));  // longer than max_seq_len
  EXPECT_TRUE(s.NeverFits(40, 40));  // 10 full-attention blocks: the pool has 8
}

TEST(CapacitySchedulerTest, BeamFamiliesDecodeWholeAndPauseWhole) {
  Fixture f({{8, 6}, {64, 6}});
  const auto p = Iota(8);
  f.manager.AddSequence(1, p.data(), p.size());  // alone: 2 blocks
  const auto q = Iota(6, 50);
  f.manager.AddSequence(2, q.data(), q.size());  // forked into 3 and 4: 2 shared blocks
  const SeqId kids[] = {3, 4};
  f.manager.ForkSequence(2, kids, 2);
  const SeqId running[] = {1, 2, 3, 4};
  const SeqId family[] = {-1, 2, 2, 2};
  RunningFamilies fams;
  fams.family = family;
  // A 3-token budget: request 1 takes one, the family's 3 do not fit the 2 left: none decodes.
  CapacityScheduler budget(&f.manager, Policy(CapacityPolicy::kGuaranteedNoEvict, 3));
  StepPlan plan = budget.Schedule(running, nullptr, nullptr, 4, nullptr, 0, fams);
  EXPECT_EQ(plan.generation, (std::vector<SeqId>{1}));
  // Request 1's next token starts a block and the beams copy their shared partial block twice
  // (the last writer keeps it): 3 blocks, 2 free. The newest request's whole family is paused.
  CapacityScheduler s(&f.manager, Policy(CapacityPolicy::kMaxUtilization));
  plan = s.Schedule(running, nullptr, nullptr, 4, nullptr, 0, fams);
  EXPECT_EQ(plan.paused, (std::vector<SeqId>{4, 3, 2}));
  EXPECT_EQ(plan.generation, (std::vector<SeqId>{1}));
  EXPECT_EQ(f.manager.NumSequences(), 1u);
  f.manager.CheckInvariants();
}

TEST(CapacitySchedulerTest, GuaranteedNoEvictChargesAFamilysSharedBlocksOnce) {
  Fixture f({{8, 15}, {64, 15}});
  const auto q = Iota(6);
  f.manager.AddSequence(1, q.data(), q.size());
  const SeqId kids[] = {2, 3};
  f.manager.ForkSequence(1, kids, 2);
  const SeqId running[] = {1, 2, 3};
  std::vector<std::int64_t> rest, refs;
  ASSERT_TRUE(f.manager.GetFamilyRemainingBlocks(running, 3, 12, &rest, &refs));
  EXPECT_EQ(rest, (std::vector<std::int64_t>{5, 5}));  // 2 copies + a new block per beam
  EXPECT_EQ(refs, (std::vector<std::int64_t>{4, 0}));  // blocks 0 and 1, 2 extra holders each
  // Per beam (2 each) plus the shared reserve (4 in window 8): 10 and 6.
  const std::int32_t finals[] = {12, 12, 12};
  EXPECT_EQ(f.manager.GetRemainingBlocks(running, finals, 3, -1, false), (std::vector<std::int64_t>{6, 6}));
  // 15 - 2 held = 13 free: a 4-token request growing to 32 tokens (3 blocks of window 8, 8 of
  // full attention) fits beside the family's 5 + 8 = 13, not beside 6 + 8 = 14.
  auto candidates = f.Candidates(1, 4, 32);
  const SeqId family[] = {1, 1, 1};
  RunningFamilies fams;
  fams.family = family;
  CapacityScheduler s(&f.manager, Policy(CapacityPolicy::kGuaranteedNoEvict));
  EXPECT_EQ(s.Schedule(running, finals, nullptr, 3, candidates.data(), 1, fams).admitted,
            (std::vector<std::int32_t>{0}));
  EXPECT_TRUE(s.Schedule(running, finals, nullptr, 3, candidates.data(), 1).admitted.empty());
  // Beams still to fork are charged at admission: 2 x (copy + 7 own blocks) do not fit.
  candidates[0].beams = 2;
  EXPECT_TRUE(s.Schedule(running, finals, nullptr, 3, candidates.data(), 1, fams).admitted.empty());
  EXPECT_TRUE(s.NeverFits(4, 32, 2));
  EXPECT_FALSE(s.NeverFits(4, 32, 0));
}

}  // namespace
}  // namespace kvcache
