// The capacity scheduler: which requests run in the next engine step so that every window has
// the blocks, decided on the manager's own estimates (kv_cache_manager_estimates.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/kv_cache_manager.h"
#include "kvcache/prepared_prompt.h"
#include "kvcache/types.h"

namespace kvcache {

enum class CapacityPolicy : std::uint8_t {
  /// Admit only what every window can hold until it finishes, on top of what the running
  /// requests will still need: running requests never run out of blocks.
  kGuaranteedNoEvict,
  /// Admit what fits its next step; pause the newest running requests when the step does not fit.
  kMaxUtilization,
};

struct CapacitySchedulerConfig {
  CapacityPolicy policy = CapacityPolicy::kGuaranteedNoEvict;
  std::int32_t max_batch_size = 0;        ///< Most requests registered at once (<= 0: no limit).
  std::int64_t max_num_batched_tokens = -1;  ///< Tokens per step; < 0: unlimited.
  bool chunked_prefill = true;
  /// The largest chunk: min(max_chunk_size, max_num_batched_tokens) with chunked prefill; < 0:
  /// whole prompts (or unlimited chunks).
  std::int32_t chunk = -1;
};

/// A request waiting for admission, in arrival order (the caller keeps never-fitting ones out:
/// see CapacityScheduler::NeverFits).
struct AdmissionCandidate {
  SeqId id = 0;
  const PreparedPrompt* context = nullptr;  ///< Its context: prompt plus tokens generated before a pause.
  std::int32_t final_tokens = 0;            ///< Most tokens it ever holds (prompt + max_new - 1).
};

/// The decisions of one step. Generation entries carry draft tokens, chunks their sizes.
struct StepPlan {
  std::vector<SeqId> generation;          ///< Running requests that decode this step, in order.
  std::vector<std::int32_t> drafts;       ///< Their draft tokens.
  std::vector<SeqId> chunks;              ///< Running requests whose next prompt chunk runs.
  std::vector<std::int32_t> chunk_sizes;  ///< Those chunks' tokens.
  std::vector<std::int32_t> admitted;     ///< Indices of admitted candidates, in order.
  std::vector<std::int32_t> admitted_chunks;  ///< Their first chunks (after the reused prefix).
  std::vector<SeqId> paused;              ///< Running requests paused and removed (newest first).
  std::vector<std::int32_t> rejected;     ///< Indices of candidates that can never fit.
};

/// First come, first served capacity scheduling of one KVCacheManager, the way TensorRT-LLM's
/// capacity scheduler works: a token budget per step, generation first, then continuing
/// prefills, then admissions in order (no overtaking). Every block question goes to the
/// manager (GetRemainingBlocks, GetStepNeeds, GetPromptRemainingBlocks, CanAllocate), so the
/// scheduler holds no block state of its own. Work per step is proportional to the running
/// requests and the candidates it looks at. Not thread-safe (the manager is).
class CapacityScheduler {
 public:
  CapacityScheduler(KVCacheManager* manager, const CapacitySchedulerConfig& config);

  const CapacitySchedulerConfig& config() const { return config_; }

  /// Plans the next step. `running` holds the registered requests in arrival order,
  /// `final_tokens[i]` the most tokens running[i] ever holds (null: as recorded by
  /// KVCacheManager::SetFinalTokens) and `drafts[i]` (null: none) the
  /// draft tokens it may verify this step; `candidates` the waiting requests in arrival order.
  /// Under max_utilization paused requests are removed from the manager (stored for reuse).
  StepPlan Schedule(const SeqId* running, const std::int32_t* final_tokens, const std::int32_t* drafts,
                    std::size_t num_running, const AdmissionCandidate* candidates, std::size_t num_candidates);

  /// Whether a request can never run: longer than max_seq_len, or its peak beyond some window's
  /// whole pool (its prompt in this scheduler's chunks).
  bool NeverFits(std::int32_t context_len, std::int32_t final_tokens) const;

 private:
  /// Tokens of a prefill chunk with `rest` prompt tokens to go and `left` in the budget (< 0:
  /// unlimited); 0 when the budget has none.
  std::int32_t ChunkFor(std::int64_t rest, std::int64_t left) const;
  /// Plans the running requests' step into plan_ (generation, then continuing prefills) and
  /// returns the budget left.
  std::int64_t PlanRunning(const SeqId* running, const std::int32_t* drafts, std::size_t n, StepPlan* plan);
  /// guaranteed_no_evict: blocks committed to the running requests' completion and the extra
  /// holdings of shared blocks.
  std::vector<std::int64_t> Reserve(const SeqId* running, const std::int32_t* final_tokens, std::size_t n);
  /// max_utilization: pauses the newest running requests until the planned step fits; returns
  /// the blocks committed to the step and to the prompts still being prefilled.
  std::vector<std::int64_t> FitRunning(std::vector<SeqId>* running, StepPlan* plan);
  std::vector<std::int64_t> PlanNeeds(const StepPlan& plan, bool with_chunks) const;
  /// Admits candidates in order while the budget, the batch size and the windows allow.
  void Admit(const AdmissionCandidate* candidates, std::size_t n, std::size_t num_running,
             std::vector<std::int64_t> committed, std::int64_t left, StepPlan* plan);
  bool Fits(const std::vector<std::int64_t>& blocks) const;

  KVCacheManager* manager_;
  CapacitySchedulerConfig config_;
  std::vector<WindowSize> windows_;
  // PlanRunning's progress of the running requests (kept: no allocation per step).
  std::vector<std::int32_t> num_tokens_;
  std::vector<std::int32_t> prompt_len_;
};

}  // namespace kvcache
