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

}  // namespace
}  // namespace kvcache
