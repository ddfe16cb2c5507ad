#include "kvcache/capacity_scheduler.h"

#include <algorithm>
#include <limits>
#include <map>

#include "kvcache/errors.h"

namespace kvcache {

CapacityScheduler::CapacityScheduler(KVCacheManager* manager, const CapacitySchedulerConfig& config)
    : manager_(manager), config_(config) {
  if (manager_ == nullptr) ThrowInvalid("capacity scheduler: no manager");
  if (config_.max_batch_size <= 0) config_.max_batch_size = std::numeric_limits<std::int32_t>::max();  // no limit
  windows_ = manager_->window_sizes();
}

std::int32_t CapacityScheduler::ChunkFor(std::int64_t rest, std::int64_t left) const {
  if (!config_.chunked_prefill) return static_cast<std::int32_t>(rest);
  std::int64_t size = config_.chunk < 0 ? rest : std::min<std::int64_t>(rest, config_.chunk);
  if (left >= 0) size = std::min(size, left);
  return static_cast<std::int32_t>(size);
}

bool CapacityScheduler::Fits(const std::vector<std::int64_t>& blocks) const {
  std::map<WindowSize, std::int32_t> need;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    need.emplace_hint(need.end(), windows_[w], static_cast<std::int32_t>(
                                                   std::clamp<std::int64_t>(blocks[w], std::numeric_limits<std::int32_t>::min(),
                                                                           std::numeric_limits<std::int32_t>::max())));
  }
  return manager_->CanAllocate(need);
}

bool CapacityScheduler::NeverFits(std::int32_t context_len, std::int32_t final_tokens) const {
  if (final_tokens > manager_->max_seq_len()) return true;
  const std::vector<std::int64_t> alone =
      manager_->GetBlocksToRunAlone(context_len, final_tokens, config_.chunked_prefill ? config_.chunk : 0);
  std::map<WindowSize, std::int32_t> need;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    need.emplace_hint(need.end(), windows_[w], static_cast<std::int32_t>(std::min<std::int64_t>(alone[w], std::numeric_limits<std::int32_t>::max())));
  }
  return !manager_->FitsWhenEmpty(need);
}

std::int64_t CapacityScheduler::PlanRunning(const SeqId* running, const std::int32_t* drafts, std::size_t n,
                                            StepPlan* plan) {
  std::int64_t left = config_.max_num_batched_tokens;
  num_tokens_.resize(n);
  prompt_len_.resize(n);
  manager_->GetProgress(running, n, num_tokens_.data(), prompt_len_.data());
  for (std::size_t i = 0; i < n; ++i) {  // generation first: one token each plus drafts
    if (num_tokens_[i] < prompt_len_[i]) continue;
    const std::int32_t d = drafts != nullptr ? drafts[i] : 0;
    if (left >= 0 && 1 + d > left) continue;
    plan->generation.push_back(running[i]);
    plan->drafts.push_back(d);
    if (left >= 0) left -= 1 + d;
  }
  for (std::size_t i = 0; i < n; ++i) {  // then continuing prefills
    const std::int64_t rest = static_cast<std::int64_t>(prompt_len_[i]) - num_tokens_[i];
    if (rest <= 0) continue;
    const std::int32_t size = ChunkFor(rest, left);
    if (size <= 0) continue;
    plan->chunks.push_back(running[i]);
    plan->chunk_sizes.push_back(size);
    if (left >= 0) left -= size;
  }
  return left;
}

std::vector<std::int64_t> CapacityScheduler::Reserve(const SeqId* running, const std::int32_t* final_tokens,
                                                     std::size_t n) {
  std::vector<std::int64_t> committed = manager_->GetRemainingBlocks(running, final_tokens, n, config_.chunk, false);
  for (std::size_t w = 0; w < windows_.size(); ++w) committed[w] += manager_->GetNumSharedBlocks(windows_[w]);
  return committed;
}

std::vector<std::int64_t> CapacityScheduler::PlanNeeds(const StepPlan& plan, bool with_chunks) const {
  std::vector<std::int32_t> tokens(plan.drafts.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = 1 + plan.drafts[i];
  return manager_->GetStepNeeds(plan.generation.data(), tokens.data(), tokens.size(), plan.chunks.data(),
                                plan.chunk_sizes.data(), with_chunks ? plan.chunks.size() : 0);
}

std::vector<std::int64_t> CapacityScheduler::FitRunning(std::vector<SeqId>* running, StepPlan* plan) {
  std::vector<std::int64_t> total;
  while (true) {
    total = PlanNeeds(*plan, true);
    if (running->empty() || Fits(total)) break;
    const SeqId victim = running->back();  // the newest running request
    running->pop_back();
    auto drop = [victim](std::vector<SeqId>* ids, std::vector<std::int32_t>* counts) {
      for (std::size_t i = 0; i < ids->size(); ++i) {
        if ((*ids)[i] == victim) {
          ids->erase(ids->begin() + static_cast<std::ptrdiff_t>(i));
          counts->erase(counts->begin() + static_cast<std::ptrdiff_t>(i));
          return;
        }
      }
    };
    drop(&plan->generation, &plan->drafts);
    drop(&plan->chunks, &plan->chunk_sizes);
    manager_->RemoveSequence(victim, /*store_for_reuse=*/true);
    plan->paused.push_back(victim);
  }
  std::vector<SeqId> prefilling;
  for (std::size_t i = 0; i < running->size(); ++i) {  // running keeps its order: a prefix of the input
    if (num_tokens_[i] < prompt_len_[i]) prefilling.push_back((*running)[i]);
  }
  if (!prefilling.empty()) {
    // What the decodes take plus what the prompts being prefilled still need until their last
    // chunk: admissions must leave room for it.
    std::vector<std::int64_t> reserve = PlanNeeds(*plan, false);
    const std::vector<std::int32_t> unused(prefilling.size(), 0);
    const std::vector<std::int64_t> rest =
        manager_->GetRemainingBlocks(prefilling.data(), unused.data(), prefilling.size(), config_.chunk, true);
    for (std::size_t w = 0; w < windows_.size(); ++w) total[w] = std::max(total[w], reserve[w] + rest[w]);
  }
  return total;
}

void CapacityScheduler::Admit(const AdmissionCandidate* candidates, std::size_t n, std::size_t num_running,
                              std::vector<std::int64_t> committed, std::int64_t left, StepPlan* plan) {
  const bool guaranteed = config_.policy == CapacityPolicy::kGuaranteedNoEvict;
  bool blocked = !plan->paused.empty();  // no admissions in a step that had to pause
  std::size_t admitted = 0;
  std::vector<std::int64_t> wanted(windows_.size());
  for (std::size_t k = 0; k < n && !blocked; ++k) {
    const AdmissionCandidate& c = candidates[k];
    if (num_running + admitted >= static_cast<std::size_t>(config_.max_batch_size)) break;
    const auto context_len = static_cast<std::int64_t>(c.context->tokens.size());
    const std::size_t batch = plan->generation.size() + plan->chunks.size() + admitted;
    if (config_.chunked_prefill && left == 0) break;
    if (!config_.chunked_prefill && left >= 0 && context_len > left && batch > 0) break;  // whole prompts
    // Exact reuse only for the first admission of the step: the blocks it takes may evict the
    // cached prefix a later one hoped for. The same lookup gives the reusable prefix.
    std::int32_t reusable = 0;
    const std::vector<std::int64_t> need = manager_->GetPromptRemainingBlocks(
        *c.context, c.final_tokens, config_.chunk, admitted == 0, !guaranteed, &reusable);
    const std::int32_t size = config_.chunked_prefill ? ChunkFor(context_len - reusable, left)
                                                      : static_cast<std::int32_t>(context_len);
    if (size <= 0) break;
    for (std::size_t w = 0; w < windows_.size(); ++w) wanted[w] = committed[w] + need[w];
    if (Fits(wanted)) {
      committed = wanted;
      plan->admitted.push_back(static_cast<std::int32_t>(k));
      plan->admitted_chunks.push_back(size);
      ++admitted;
      if (left >= 0) left = std::max<std::int64_t>(0, left - size);
    } else if (num_running == 0 && batch == 0) {
      // Nothing runs, so nothing will change the pools or the cache: it never fits.
      plan->rejected.push_back(static_cast<std::int32_t>(k));
    } else {
      blocked = true;
    }
  }
}

StepPlan CapacityScheduler::Schedule(const SeqId* running, const std::int32_t* final_tokens,
                                     const std::int32_t* drafts, std::size_t num_running,
                                     const AdmissionCandidate* candidates, std::size_t num_candidates) {
  for (std::size_t k = 0; k < num_candidates; ++k) {
    if (candidates[k].context == nullptr) ThrowInvalid("capacity scheduler: a candidate without a context");
  }
  StepPlan plan;
  const std::int64_t left = PlanRunning(running, drafts, num_running, &plan);
  std::vector<std::int64_t> committed;
  std::size_t still_running = num_running;
  if (config_.policy == CapacityPolicy::kGuaranteedNoEvict) {
    committed = Reserve(running, final_tokens, num_running);
  } else {
    std::vector<SeqId> kept(running, running + num_running);
    committed = FitRunning(&kept, &plan);
    still_running = kept.size();
  }
  Admit(candidates, num_candidates, still_running, std::move(committed), left, &plan);
  return plan;
}

}  // namespace kvcache
