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

void CapacityScheduler::AddBeams(std::int32_t fork_tokens, std::int32_t final_tokens, std::int32_t beams,
                                 std::vector<std::int64_t>* out) const {
  if (beams <= 0 || fork_tokens < 1) return;
  const std::vector<std::int64_t> own = manager_->GetForkedBeamBlocks(fork_tokens, std::max(fork_tokens, final_tokens));
  for (std::size_t w = 0; w < windows_.size(); ++w) (*out)[w] += beams * own[w];
}

std::vector<std::int64_t> CapacityScheduler::BlocksToRunAlone(std::int32_t context_len, std::int32_t final_tokens,
                                                              std::int32_t beams) const {
  std::vector<std::int64_t> alone =
      manager_->GetBlocksToRunAlone(context_len, final_tokens, config_.chunked_prefill ? config_.chunk : 0);
  AddBeams(context_len, final_tokens, beams, &alone);
  return alone;
}

bool CapacityScheduler::NeverFits(std::int32_t context_len, std::int32_t final_tokens, std::int32_t beams) const {
  if (final_tokens > manager_->max_seq_len()) return true;
  if (beams >= config_.max_batch_size) return true;  // its beams never fit the batch
  const std::vector<std::int64_t> alone = BlocksToRunAlone(context_len, final_tokens, beams);
  std::map<WindowSize, std::int32_t> need;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    need.emplace_hint(need.end(), windows_[w], static_cast<std::int32_t>(std::min<std::int64_t>(alone[w], std::numeric_limits<std::int32_t>::max())));
  }
  return !manager_->FitsWhenEmpty(need);
}

std::int64_t CapacityScheduler::PlanChunks(const SeqId* running, std::size_t n, std::int64_t left, StepPlan* plan) {
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t rest = static_cast<std::int64_t>(prompt_len_[i]) - num_tokens_[i];
    if (rest <= 0) continue;
    std::int32_t size = ChunkFor(rest, left);
    if (size <= 0) continue;
    // A chunk ends where a recurrent checkpoint is to be taken, never straddles it.
    if (manager_->num_state_groups() > 0) size = manager_->GetChunkLimit(running[i], size);
    plan->chunks.push_back(running[i]);
    plan->chunk_sizes.push_back(size);
    if (left >= 0) left -= size;
  }
  return left;
}

std::int64_t CapacityScheduler::PlanRunning(const SeqId* running, const std::int32_t* drafts, std::size_t n,
                                            bool progress_known, StepPlan* plan) {
  std::int64_t left = config_.max_num_batched_tokens;
  if (!progress_known) {
    num_tokens_.resize(n);
    prompt_len_.resize(n);
    manager_->GetProgress(running, n, num_tokens_.data(), prompt_len_.data());
  }
  for (std::size_t i = 0; i < n; ++i) {  // generation first: one token each plus drafts
    if (num_tokens_[i] < prompt_len_[i]) continue;
    const std::int32_t d = drafts != nullptr ? drafts[i] : 0;
    if (left >= 0 && 1 + d > left) continue;
    plan->generation.push_back(running[i]);
    plan->drafts.push_back(d);
    if (left >= 0) left -= 1 + d;
  }
  return PlanChunks(running, n, left, plan);  // then continuing prefills
}

namespace {
constexpr std::int64_t kFamilyWaits = -1;  // a member is in prefill or waiting: no decode
constexpr std::int64_t kFamilySkips = -2;  // its tokens exceed the budget left
constexpr std::int64_t kFamilyRuns = -3;   // it decodes this step
}  // namespace

std::int64_t CapacityScheduler::PlanFamilies(const SeqId* running, const std::int32_t* drafts, std::size_t n,
                                             const AdmissionCandidate* candidates, std::size_t num_candidates,
                                             const RunningFamilies& families, StepPlan* plan) {
  std::int64_t left = config_.max_num_batched_tokens;
  num_tokens_.resize(n);
  prompt_len_.resize(n);
  manager_->GetProgress(running, n, num_tokens_.data(), prompt_len_.data());
  family_tokens_.clear();
  for (std::size_t i = 0; i < n; ++i) {  // each family's generation tokens, or kFamilyWaits
    if (families_[i] < 0) continue;
    std::int64_t& t = family_tokens_[families_[i]];
    if (t == kFamilyWaits) continue;
    if (num_tokens_[i] < prompt_len_[i]) {
      t = kFamilyWaits;
    } else {
      t += 1 + (drafts != nullptr ? drafts[i] : 0);
    }
  }
  for (std::size_t k = 0; k < num_candidates; ++k) {  // a member waits to be admitted
    if (candidates[k].family < 0) continue;
    const auto it = family_tokens_.find(candidates[k].family);
    if (it != family_tokens_.end()) it->second = kFamilyWaits;
  }
  for (std::size_t k = 0; k < families.num_waiting; ++k) {
    const auto it = family_tokens_.find(families.waiting[k]);
    if (it != family_tokens_.end()) it->second = kFamilyWaits;
  }
  for (std::size_t i = 0; i < n; ++i) {  // generation first: whole families, in order of their first member
    if (num_tokens_[i] < prompt_len_[i]) continue;
    const std::int32_t d = drafts != nullptr ? drafts[i] : 0;
    if (families_[i] < 0) {
      if (left >= 0 && 1 + d > left) continue;
      if (left >= 0) left -= 1 + d;
    } else {
      std::int64_t& t = family_tokens_[families_[i]];
      if (t == kFamilyWaits || t == kFamilySkips) continue;
      if (t != kFamilyRuns) {
        // A family larger than the whole budget decodes alone (as a whole prompt longer than
        // the budget is prefilled alone): else it would never decode.
        const bool alone = left == config_.max_num_batched_tokens && plan->generation.empty();
        if (left >= 0 && t > left && !alone) {
          t = kFamilySkips;
          continue;
        }
        if (left >= 0) left = std::max<std::int64_t>(0, left - t);
        t = kFamilyRuns;
      }
    }
    plan->generation.push_back(running[i]);
    plan->drafts.push_back(d);
  }
  return PlanChunks(running, n, left, plan);  // then continuing prefills
}

std::vector<std::int64_t> CapacityScheduler::Reserve(const SeqId* running, const std::int32_t* final_tokens,
                                                     std::size_t n, const std::int32_t* beams,
                                                     std::vector<std::int64_t> remaining) {
  if (families_ == nullptr) {
    std::vector<std::int64_t> committed =
        remaining.empty() ? manager_->GetRemainingBlocks(running, final_tokens, n, config_.chunk, false)
                          : std::move(remaining);
    for (std::size_t w = 0; w < windows_.size(); ++w) committed[w] += manager_->GetNumSharedBlocks(windows_[w]);
    return committed;
  }
  // A family of several running beams in lockstep is charged as one: its shared blocks once,
  // each beam's own future blocks (KVCacheManager::GetFamilyRemainingBlocks); its own extra
  // holdings leave the shared-block reserve. The rest: each request alone.
  std::unordered_map<SeqId, std::vector<std::size_t>> groups;
  std::vector<std::size_t> singles;
  for (std::size_t i = 0; i < n; ++i) {
    if (families_[i] >= 0) {
      groups[families_[i]].push_back(i);
    } else {
      singles.push_back(i);
    }
  }
  std::vector<std::int64_t> committed(windows_.size(), 0);
  std::vector<std::int64_t> reserve(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) reserve[w] = manager_->GetNumSharedBlocks(windows_[w]);
  std::vector<SeqId> ids;
  std::vector<std::int64_t> rest, refs;
  for (const auto& [family, members] : groups) {
    ids.clear();
    std::int32_t final = 0;
    for (const std::size_t i : members) {
      ids.push_back(running[i]);
      final = std::max(final, final_tokens != nullptr ? final_tokens[i] : manager_->max_seq_len());
    }
    if (members.size() < 2 || !manager_->GetFamilyRemainingBlocks(ids.data(), ids.size(), final, &rest, &refs)) {
      singles.insert(singles.end(), members.begin(), members.end());
      continue;
    }
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      committed[w] += rest[w];
      reserve[w] -= refs[w];
    }
  }
  ids.clear();
  std::vector<std::int32_t> finals;
  for (const std::size_t i : singles) {
    ids.push_back(running[i]);
    finals.push_back(final_tokens != nullptr ? final_tokens[i] : manager_->max_seq_len());
  }
  if (!ids.empty()) {
    rest = manager_->GetRemainingBlocks(ids.data(), final_tokens != nullptr ? finals.data() : nullptr, ids.size(),
                                        config_.chunk, false);
    for (std::size_t w = 0; w < windows_.size(); ++w) committed[w] += rest[w];
  }
  for (std::size_t w = 0; w < windows_.size(); ++w) committed[w] += std::max<std::int64_t>(0, reserve[w]);
  if (beams != nullptr) {  // beams not forked yet: each forks after the prompt and takes its own blocks
    for (std::size_t i = 0; i < n; ++i) {
      if (beams[i] <= 0) continue;
      const std::int32_t final = final_tokens != nullptr ? final_tokens[i] : manager_->max_seq_len();
      AddBeams(std::max(num_tokens_[i], prompt_len_[i]), final, beams[i], &committed);
    }
  }
  return committed;
}

std::vector<std::int64_t> CapacityScheduler::PlanNeeds(const StepPlan& plan, bool with_chunks) const {
  std::vector<std::int32_t> tokens(plan.drafts.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = 1 + plan.drafts[i];
  return manager_->GetStepNeeds(plan.generation.data(), tokens.data(), tokens.size(), plan.chunks.data(),
                                plan.chunk_sizes.data(), with_chunks ? plan.chunks.size() : 0);
}

void CapacityScheduler::PauseFamily(SeqId family, const SeqId* running, std::vector<std::size_t>* kept,
                                    StepPlan* plan) {
  auto drop = [](SeqId victim, std::vector<SeqId>* ids, std::vector<std::int32_t>* counts) {
    for (std::size_t i = 0; i < ids->size(); ++i) {
      if ((*ids)[i] == victim) {
        ids->erase(ids->begin() + static_cast<std::ptrdiff_t>(i));
        counts->erase(counts->begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }
  };
  for (std::size_t k = kept->size(); k-- > 0;) {  // newest first
    const std::size_t i = (*kept)[k];
    if (FamilyKey(running, i) != family) continue;
    const SeqId victim = running[i];
    kept->erase(kept->begin() + static_cast<std::ptrdiff_t>(k));
    drop(victim, &plan->generation, &plan->drafts);
    drop(victim, &plan->chunks, &plan->chunk_sizes);
    manager_->RemoveSequence(victim, /*store_for_reuse=*/true);
    plan->paused.push_back(victim);
  }
}

std::vector<std::int64_t> CapacityScheduler::FitRunning(const SeqId* running, std::vector<std::size_t>* kept,
                                                        StepPlan* plan) {
  std::vector<std::int64_t> total;
  while (true) {
    total = PlanNeeds(*plan, true);
    if (kept->empty() || Fits(total)) break;
    // The newest running request, with its whole family.
    PauseFamily(FamilyKey(running, kept->back()), running, kept, plan);
  }
  std::vector<SeqId> prefilling;
  for (const std::size_t i : *kept) {  // kept keeps the input's order
    if (num_tokens_[i] < prompt_len_[i]) prefilling.push_back(running[i]);
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
                              std::size_t slots,
                              std::vector<std::int64_t> committed, std::int64_t left, StepPlan* plan) {
  const bool guaranteed = config_.policy == CapacityPolicy::kGuaranteedNoEvict;
  bool blocked = !plan->paused.empty();  // no admissions in a step that had to pause
  std::size_t admitted = 0;
  std::vector<std::int64_t> wanted(windows_.size());
  for (std::size_t k = 0; k < n && !blocked; ++k) {
    const AdmissionCandidate& c = candidates[k];
    // Its beams fork into batch slots of their own (fork_sequence refuses more than the batch).
    const std::size_t take = 1 + static_cast<std::size_t>(std::max<std::int32_t>(0, c.beams));
    if (slots + take > static_cast<std::size_t>(config_.max_batch_size)) break;
    const auto context_len = static_cast<std::int64_t>(c.context->tokens.size());
    const std::size_t batch = plan->generation.size() + plan->chunks.size() + admitted;
    if (config_.chunked_prefill && left == 0) break;
    if (!config_.chunked_prefill && left >= 0 && context_len > left && batch > 0) break;  // whole prompts
    // Exact reuse only for the first admission of the step: the blocks it takes may evict the
    // cached prefix a later one hoped for. The same lookup gives the reusable prefix.
    std::int32_t reusable = 0;
    std::vector<std::int64_t> need = manager_->GetPromptRemainingBlocks(
        *c.context, c.final_tokens, config_.chunk, admitted == 0, !guaranteed, &reusable);
    if (guaranteed) AddBeams(static_cast<std::int32_t>(context_len), c.final_tokens, c.beams, &need);
    std::int32_t size = config_.chunked_prefill ? ChunkFor(context_len - reusable, left)
                                                : static_cast<std::int32_t>(context_len);
    if (size <= 0) break;
    if (config_.chunked_prefill && manager_->num_state_groups() > 0) {
      size = manager_->GetPromptChunkLimit(*c.context, size);  // ends at a checkpoint it is to take
    }
    for (std::size_t w = 0; w < windows_.size(); ++w) wanted[w] = committed[w] + need[w];
    if (Fits(wanted)) {
      committed = wanted;
      slots += take;
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
                                     const AdmissionCandidate* candidates, std::size_t num_candidates,
                                     const RunningFamilies& families) {
  for (std::size_t k = 0; k < num_candidates; ++k) {
    if (candidates[k].context == nullptr) ThrowInvalid("capacity scheduler: a candidate without a context");
  }
  StepPlan plan;
  families_ = families.family;
  const bool guaranteed = config_.policy == CapacityPolicy::kGuaranteedNoEvict;
  std::vector<std::int64_t> remaining;  // guaranteed_no_evict without families: with the progress, one pass
  if (guaranteed && families_ == nullptr) {
    num_tokens_.resize(num_running);
    prompt_len_.resize(num_running);
    remaining = manager_->GetRemainingBlocks(running, final_tokens, num_running, config_.chunk, num_tokens_.data(),
                                             prompt_len_.data());
  }
  const std::int64_t left =
      families_ != nullptr ? PlanFamilies(running, drafts, num_running, candidates, num_candidates, families, &plan)
                           : PlanRunning(running, drafts, num_running, !remaining.empty(), &plan);
  std::vector<std::int64_t> committed;
  std::size_t still_running = num_running;
  std::vector<std::size_t> kept;
  if (guaranteed) {
    committed = Reserve(running, final_tokens, num_running, families.beams, std::move(remaining));
  } else {
    kept.resize(num_running);
    for (std::size_t i = 0; i < num_running; ++i) kept[i] = i;
    committed = FitRunning(running, &kept, &plan);
    still_running = kept.size();
  }
  std::size_t slots = still_running;
  if (families.beams != nullptr) {  // the running requests' beams still to fork
    for (std::size_t k = 0; k < (kept.empty() ? num_running : kept.size()); ++k) {
      const std::size_t i = kept.empty() ? k : kept[k];
      slots += static_cast<std::size_t>(std::max<std::int32_t>(0, families.beams[i]));
    }
  }
  Admit(candidates, num_candidates, still_running, slots, std::move(committed), left, &plan);
  if (families_ != nullptr && plan.generation.empty() && plan.chunks.empty() && plan.admitted.empty() &&
      plan.paused.empty() && still_running > 0) {
    // Nothing runs: the registered members of some family wait for siblings that do not fit.
    // The newest such family gives its blocks back (stored for reuse) and resumes later.
    if (kept.empty()) {
      kept.resize(num_running);
      for (std::size_t i = 0; i < num_running; ++i) kept[i] = i;
    }
    for (std::size_t k = kept.size(); k-- > 0;) {
      const std::size_t i = kept[k];
      if (families_[i] < 0) continue;
      const SeqId family = families_[i];
      const auto it = family_tokens_.find(family);
      if (it == family_tokens_.end() || it->second != kFamilyWaits) continue;
      bool alone = true;  // only this family holds blocks: its waiting members never fit
      for (const std::size_t j : kept) alone = alone && families_[j] == family;
      if (!alone) {
        PauseFamily(family, running, &kept, &plan);
        break;
      }
      for (std::size_t c = 0; c < num_candidates; ++c) {
        if (candidates[c].family == family) plan.rejected.push_back(static_cast<std::int32_t>(c));
      }
      break;
    }
  }
  families_ = nullptr;
  return plan;
}

}  // namespace kvcache
