// The capacity scheduler: which requests run in the next engine step so that every window has
// the blocks, decided on the manager's own estimates (kv_cache_manager_estimates.cpp).
#pragma once

#include <cstdint>
#include <unordered_map>
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
  /// Its beam family (< 0: none): the beams of one request. See CapacityScheduler::Schedule.
  SeqId family = -1;
  /// Beams still to be forked from it (num_beams - 1 before its first fork, else 0): its
  /// admission is charged their own blocks (KVCacheManager::GetForkedBeamBlocks) too.
  std::int32_t beams = 0;
};

/// Beam families of the running requests (parallel to `running`; a null array: none).
struct RunningFamilies {
  const SeqId* family = nullptr;      ///< Family id of each running request (< 0: none).
  const std::int32_t* beams = nullptr;  ///< Beams still to fork from each (guaranteed_no_evict charges them).
  /// Families with a member waiting (paused or not admitted yet), candidate or not: they do not decode.
  const SeqId* waiting = nullptr;
  std::size_t num_waiting = 0;
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
  ///
  /// Beam families (`families`, and AdmissionCandidate::family): the requests that share a
  /// family id are the beams of one request. A family decodes only when every member is
  /// registered and past its prompt, and then all its members decode in the same step (or none:
  /// the token budget takes the family's tokens at once); members still in prefill run their
  /// chunks. max_utilization pauses whole families: the newest running request's family, every
  /// registered member of it. Waiting members are admitted in order like any request, so a
  /// resumed family's members come back before anything behind them; when nothing can run
  /// because registered members wait for siblings that do not fit, the newest such family is
  /// paused, so that its blocks serve the others in a later step, or, when it is the only one
  /// running (nothing will ever free blocks for them), its waiting members are rejected. A
  /// family whose tokens exceed the whole budget decodes alone.
  StepPlan Schedule(const SeqId* running, const std::int32_t* final_tokens, const std::int32_t* drafts,
                    std::size_t num_running, const AdmissionCandidate* candidates, std::size_t num_candidates,
                    const RunningFamilies& families = RunningFamilies{});

  /// Whether a request can never run: longer than max_seq_len, or its peak beyond some window's
  /// whole pool (its prompt in this scheduler's chunks), with `beams` more beams forked from it
  /// after its prompt (each charged KVCacheManager::GetForkedBeamBlocks), or 1 + `beams`
  /// sequences beyond max_batch_size.
  bool NeverFits(std::int32_t context_len, std::int32_t final_tokens, std::int32_t beams = 0) const;
  /// Per window, the most blocks such a request holds from an otherwise empty pool: its own
  /// sequence (KVCacheManager::GetBlocksToRunAlone, this scheduler's chunks) plus `beams` forked
  /// beams' own blocks.
  std::vector<std::int64_t> BlocksToRunAlone(std::int32_t context_len, std::int32_t final_tokens,
                                             std::int32_t beams = 0) const;

 private:
  /// Tokens of a prefill chunk with `rest` prompt tokens to go and `left` in the budget (< 0:
  /// unlimited); 0 when the budget has none.
  std::int32_t ChunkFor(std::int64_t rest, std::int64_t left) const;
  /// The chunks of the running requests still in prefill (num_tokens_ / prompt_len_ filled), in
  /// order, from the token budget `left` (< 0: unlimited); returns the budget left.
  std::int64_t PlanChunks(const SeqId* running, std::size_t n, std::int64_t left, StepPlan* plan);
  /// Plans the running requests' step into plan_ (generation, then continuing prefills) and
  /// returns the budget left.
  /// `progress_known`: num_tokens_ / prompt_len_ already hold the running requests' progress.
  std::int64_t PlanRunning(const SeqId* running, const std::int32_t* drafts, std::size_t n, bool progress_known,
                           StepPlan* plan);
  /// PlanRunning with beam families: a family decodes whole or not at all, and only once every
  /// member is registered and past its prompt.
  std::int64_t PlanFamilies(const SeqId* running, const std::int32_t* drafts, std::size_t n,
                            const AdmissionCandidate* candidates, std::size_t num_candidates,
                            const RunningFamilies& families, StepPlan* plan);
  /// guaranteed_no_evict: blocks committed to the running requests' completion and the extra
  /// holdings of shared blocks.
  /// `remaining`: without families, the running requests' GetRemainingBlocks if already
  /// computed (else empty).
  std::vector<std::int64_t> Reserve(const SeqId* running, const std::int32_t* final_tokens, std::size_t n,
                                    const std::int32_t* beams, std::vector<std::int64_t> remaining);
  /// max_utilization: pauses the newest running requests (with families: the newest running
  /// request's whole family) until the planned step fits; returns the blocks committed to the
  /// step and to the prompts still being prefilled, and leaves the kept requests in `running`.
  std::vector<std::int64_t> FitRunning(const SeqId* running, std::vector<std::size_t>* kept, StepPlan* plan);
  /// Pauses every kept running request whose family key is `family` (newest first): removes it
  /// from the manager, the plan and `kept` (indices into running).
  void PauseFamily(SeqId family, const SeqId* running, std::vector<std::size_t>* kept, StepPlan* plan);
  /// The family key of running[i]: its family id, or its own id without one.
  SeqId FamilyKey(const SeqId* running, std::size_t i) const {
    return families_ != nullptr && families_[i] >= 0 ? families_[i] : running[i];
  }
  /// The beams' own blocks (KVCacheManager::GetForkedBeamBlocks) times `beams`, added to `out`.
  void AddBeams(std::int32_t fork_tokens, std::int32_t final_tokens, std::int32_t beams,
                std::vector<std::int64_t>* out) const;
  std::vector<std::int64_t> PlanNeeds(const StepPlan& plan, bool with_chunks) const;
  /// Admits candidates in order while the budget, the batch size and the windows allow.
  /// `slots`: the batch slots the running requests take, their beams still to fork included
  /// (a candidate takes 1 + its beams).
  void Admit(const AdmissionCandidate* candidates, std::size_t n, std::size_t num_running, std::size_t slots,
             std::vector<std::int64_t> committed, std::int64_t left, StepPlan* plan);
  bool Fits(const std::vector<std::int64_t>& blocks) const;

  KVCacheManager* manager_;
  CapacitySchedulerConfig config_;
  std::vector<WindowSize> windows_;
  // PlanRunning's progress of the running requests (kept: no allocation per step).
  std::vector<std::int32_t> num_tokens_;
  std::vector<std::int32_t> prompt_len_;
  // The running requests' family ids during Schedule (null: no families).
  const SeqId* families_ = nullptr;
  // PlanFamilies' state of each family: its generation tokens while undecided, else one of
  // kFamilyWaits (a member in prefill or waiting), kFamilySkips (over the budget), kFamilyRuns.
  std::unordered_map<SeqId, std::int64_t> family_tokens_;
};

}  // namespace kvcache
