// KVCacheManager, recurrent-state half: the state pools, working slots, checkpoints and their
// place in the prefix-hit search.
//
// A hybrid prefix hit at P blocks needs every group to resume there: full attention every block
// before P, a sliding window the blocks of its last window before P, every state group a
// checkpoint taken exactly after P blocks (the tree node of position P - 1). The windows' search
// (ServedPrefix) gives the longest prefix they serve; StateServed walks down from it to the
// longest that the state groups accept too, each candidate checked by every kind. Each kind only
// accepts or rejects a length and a rejected one is never reconsidered, so the walk is the
// fixed point of "every kind shortens the candidate to what it can serve".
//
// State slots move only here: AdmitState, ForkState, TakeCheckpoint, StoreCheckpoints and
// ReleaseState take and give back every slot. The manager copies states itself when the source
// is final (a hit's restore, a fork, zeroing a fresh state); a checkpoint of the working state is
// taken after the forward pass that reaches it, by the engine (TakeStateCopies) or by the manager
// (SaveCheckpoints).
#include <algorithm>
#include <cstring>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {

void KVCacheManager::MakeStatePools(const ManagerConfig& config, std::vector<StateGroupLayout> groups) {
  checkpoint_policy_ = config.checkpoint_policy;
  if (groups.empty()) return;
  if (max_batch_size_ <= 0) {
    ThrowInvalid("a model with recurrent layers needs max_batch_size > 0: every registered sequence holds one state "
                 "slot, and max_batch_size of them are kept available");
  }
  if (config.state_slots <= max_batch_size_) {
    ThrowInvalid("state_slots must exceed max_batch_size (", max_batch_size_, ": one working slot per sequence, and "
                 "room for a checkpoint), got ", config.state_slots);
  }
  if (config.checkpoint_policy.interval_blocks < 0) {
    ThrowInvalid("checkpoint_policy.interval_blocks must be >= 0, got ", config.checkpoint_policy.interval_blocks);
  }
  if (config.checkpoint_policy.max_per_path < 0) {
    ThrowInvalid("checkpoint_policy.max_per_path must be >= 0, got ", config.checkpoint_policy.max_per_path);
  }
  if (!config.shared_cache_url.empty()) {
    ThrowInvalid("the shared tier (shared_cache_url) does not hold recurrent states yet: a hit from it could not "
                 "resume a model with recurrent layers");
  }
  const auto nw = static_cast<std::int32_t>(windows_.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    states_.push_back(std::make_unique<StatePool>(std::move(groups[g]), static_cast<std::int32_t>(g), config.state_slots,
                                                  config.state_secondary_slots, backend_.get(), tree_.get(),
                                                  nw + static_cast<std::int32_t>(g), events_.get()));
  }
}

std::vector<StateGroupInfo> KVCacheManager::state_groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StateGroupInfo> out;
  for (const auto& pool : states_) {
    StateGroupInfo info;
    info.layers = pool->layout().layers;
    info.tensors = pool->layout().tensors;
    info.slot_bytes = pool->layout().slot_bytes;
    info.num_slots = pool->num_slots();
    info.num_secondary = pool->num_secondary();
    info.ptr = reinterpret_cast<std::uintptr_t>(pool->memory());
    out.push_back(std::move(info));
  }
  return out;
}

std::int32_t KVCacheManager::GetStateSlot(SeqId id, std::int32_t group) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& seq = Find(id);
  if (group < 0 || static_cast<std::size_t>(group) >= states_.size()) {
    ThrowInvalid("state group ", group, " does not exist (this manager has ", states_.size(), ")");
  }
  return seq.states[static_cast<std::size_t>(group)].working;
}

StateView KVCacheManager::GetStateView(std::int32_t layer, std::int32_t tensor) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& pool : states_) {
    const StateGroupLayout& g = pool->layout();
    const auto it = std::find(g.layers.begin(), g.layers.end(), layer);
    if (it == g.layers.end()) continue;
    if (tensor < 0 || static_cast<std::size_t>(tensor) >= g.tensors.size()) {
      ThrowInvalid("recurrent layer ", layer, " has ", g.tensors.size(), " state tensors, not ", tensor);
    }
    if (pool->memory() == nullptr) throw KVCacheError("state views need a backend with memory (not virtual)");
    const StateTensorSpec& t = g.tensors[static_cast<std::size_t>(tensor)];
    StateView v;
    v.dtype = t.dtype;
    v.backend = backend_->Kind();
    const std::size_t offset = static_cast<std::size_t>(it - g.layers.begin()) * g.layer_bytes +
                               g.tensor_offsets[static_cast<std::size_t>(tensor)];
    v.data = static_cast<unsigned char*>(pool->memory()) + offset;
    v.shape.push_back(pool->num_slots());
    v.shape.insert(v.shape.end(), t.shape.begin(), t.shape.end());
    v.strides.assign(v.shape.size(), 0);
    std::int64_t stride = DTypeBytes(t.dtype);
    for (std::size_t d = v.shape.size(); d-- > 1;) {
      v.strides[d] = stride;
      stride *= v.shape[d];
    }
    v.strides[0] = static_cast<std::int64_t>(g.slot_bytes);
    return v;
  }
  ThrowInvalid("recurrent layer ", layer, " does not exist");
}

bool KVCacheManager::SlidingWindowsServe(const std::vector<NodeId>& path, std::int32_t p) const {
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const AttentionKind& kind = *kinds_[w];
    if (!kind.ReleasesBlocks()) continue;  // full attention serves every p up to its cut
    for (std::int32_t i = kind.FirstNeededBlock(p, tpb_); i < p; ++i) {
      if (tree_->Block(path[static_cast<std::size_t>(i)], static_cast<std::int32_t>(w)) == kNullBlock) return false;
    }
  }
  return true;
}

bool KVCacheManager::StateSlack(std::int32_t takes, std::size_t sequences_after) const {
  const std::int64_t reserve = static_cast<std::int64_t>(max_batch_size_) - static_cast<std::int64_t>(sequences_after);
  for (const auto& pool : states_) {
    if (static_cast<std::int64_t>(pool->NumAvailable()) - takes < std::max<std::int64_t>(reserve, 0)) return false;
  }
  return true;
}

std::int32_t KVCacheManager::StateServed(const std::vector<NodeId>& path, std::int32_t served, ReusePlan* plan) const {
  plan->restore.assign(states_.size(), kNoSlot);
  // A hit holds its checkpoints while the working slot is taken: two slots of every group.
  if (!StateSlack(2, sequences_.size() + 1)) return 0;
  for (std::int32_t p = served; p > 0; --p) {
    const NodeId node = path[static_cast<std::size_t>(p - 1)];
    bool all = true;
    for (const auto& pool : states_) all = all && pool->CheckpointAt(node) != kNoSlot;
    if (!all || (p < served && !SlidingWindowsServe(path, p))) continue;
    for (std::size_t g = 0; g < states_.size(); ++g) plan->restore[g] = states_[g]->CheckpointAt(node);
    return p;
  }
  return 0;
}

void KVCacheManager::PlanCheckpoints(std::int32_t n, std::int32_t reused, std::int32_t attention_blocks,
                                     std::vector<std::int32_t>* out) const {
  out->clear();
  if (states_.empty() || !reuse_ || n < 2) return;
  // The last prompt token is computed again by any hit, so the deepest useful checkpoint is the
  // last block boundary before it.
  const std::int32_t last = (n - 1) / tpb_ * tpb_;
  const CheckpointPolicy& cp = checkpoint_policy_;
  if (cp.prompt_end && last > reused) out->push_back(last);
  if (cp.interval_blocks > 0) {
    const std::int64_t step = static_cast<std::int64_t>(cp.interval_blocks) * tpb_;
    for (std::int64_t p = step; p <= last; p += step) {
      if (p > reused) out->push_back(static_cast<std::int32_t>(p));
    }
  }
  const std::int32_t junction = attention_blocks * tpb_;
  if (cp.junction && junction > reused && junction <= last) out->push_back(junction);
  std::sort(out->begin(), out->end());
  out->erase(std::unique(out->begin(), out->end()), out->end());
}

void KVCacheManager::AdmitState(Sequence& seq, const ReusePlan& plan, std::int32_t first_end) {
  if (states_.empty()) return;
  seq.states.assign(states_.size(), SequenceState{});
  const bool hit = plan.full_blocks > 0;
  for (std::size_t g = 0; g < states_.size(); ++g) {
    StatePool& pool = *states_[g];
    const SlotId src = hit ? plan.restore[g] : kNoSlot;
    if (src != kNoSlot) pool.Hold(src);  // Take must not evict the checkpoint it is about to copy
    const SlotId working = pool.Take(/*pending=*/false);
    KVC_CHECK(working != kNoSlot, "no state slot for a registered sequence (max_batch_size reserve broken)");
    seq.states[g].working = working;
    CopySlot(g, src, working);
    if (src != kNoSlot) {
      pool.Unhold(src);
      pool.Touch(src, /*hit=*/true);
    }
  }
  if (hit) {
    ++state_counters_.restored;
    if (states_[0]->IsSecondary(plan.restore[0])) ++state_counters_.onboarded;
  }
  PlanCheckpoints(seq.prompt_len, plan.reused_tokens, plan.attention_blocks, &seq.checkpoint_plan);
  AdvanceState(seq, plan.reused_tokens, first_end);
}

void KVCacheManager::CopySlot(std::size_t g, SlotId src, SlotId dst) {
  StatePool& pool = *states_[g];
  if (pool.memory() == nullptr) return;
  const std::size_t bytes = pool.layout().slot_bytes;
  void* to = pool.Address(dst);
  if (src == kNoSlot) {
    if (zeros_bytes_ < bytes) {
      if (zeros_ptr_ != nullptr) backend_->Free(CacheLevel::kSecondary, zeros_ptr_);
      zeros_ptr_ = nullptr;
      zeros_ptr_ = backend_->Allocate(CacheLevel::kSecondary, bytes);  // zero-filled host memory
      zeros_bytes_ = bytes;
    }
    backend_->Copy2D(to, CacheLevel::kPrimary, bytes, zeros_ptr_, CacheLevel::kSecondary, bytes, bytes, 1);
  } else {
    backend_->Copy2D(to, CacheLevel::kPrimary, bytes, pool.Address(src), pool.Level(src), bytes, bytes, 1);
  }
  backend_->Synchronize();
}

void KVCacheManager::AdvanceState(Sequence& seq, std::int32_t from, std::int32_t to) {
  if (states_.empty() || !reuse_ || to <= from) return;
  if (from < seq.prompt_len) {
    // A prefill chunk [from, to): the checkpoints it ends at are taken, those it straddles lost.
    std::vector<std::int32_t>& plan = seq.checkpoint_plan;
    std::size_t i = 0;
    bool took = false;
    for (; i < plan.size() && plan[i] <= to; ++i) {
      if (plan[i] == to) {
        TakeCheckpoint(seq, to, /*rolling=*/false);
        took = true;
      } else if (plan[i] > from) {
        ++state_counters_.skipped;
      }
    }
    plan.erase(plan.begin(), plan.begin() + static_cast<std::ptrdiff_t>(i));
    if (!took && checkpoint_policy_.chunk_end && to % tpb_ == 0 && to <= (seq.prompt_len - 1) / tpb_ * tpb_) {
      TakeCheckpoint(seq, to, /*rolling=*/false);
    }
  } else if (checkpoint_policy_.finish && to % tpb_ == 0) {
    TakeCheckpoint(seq, to, /*rolling=*/true);
  }
}

void KVCacheManager::TakeCheckpoint(Sequence& seq, std::int32_t position, bool rolling) {
  if (rolling) {
    std::vector<PendingCheckpoint>& first = seq.states[0].pending;
    const auto it = std::find_if(first.begin(), first.end(), [](const PendingCheckpoint& c) { return c.rolling; });
    if (it != first.end()) {
      const auto k = static_cast<std::size_t>(it - first.begin());
      for (std::size_t g = 0; g < states_.size(); ++g) {
        PendingCheckpoint& c = seq.states[g].pending[k];
        c.position = position;
        if (c.ready) {  // written by an earlier step: write it again (a queued copy stays queued)
          c.ready = false;
          queued_copies_.push_back(QueuedCopy{StateCopy{static_cast<std::int32_t>(g), seq.states[g].working, c.slot}, seq.id});
        }
      }
      return;
    }
  }
  // A decoding sequence's first rolling checkpoint takes a free slot only, never evicting a
  // cached checkpoint for a state that may never be reused, unless this boundary is the last
  // one the sequence will reach (its final length is known: SetFinalTokens).
  const bool evict = !rolling || (seq.final_tokens > 0 && position == (seq.final_tokens - 1) / tpb_ * tpb_);
  bool room = StateSlack(1, sequences_.size());
  for (const auto& pool : states_) room = room && (evict || pool->NumFree() > 0);
  if (!room) {
    // A rolling checkpoint refused a free slot is tried again at the next boundary: counted
    // only at the last one.
    if (!rolling || evict) ++state_counters_.skipped;
    return;
  }
  for (std::size_t g = 0; g < states_.size(); ++g) {
    const SlotId slot = states_[g]->Take(/*pending=*/true);
    KVC_CHECK(slot != kNoSlot, "a state group short of a slot its slack promised");
    seq.states[g].pending.push_back(PendingCheckpoint{position, slot, false, rolling});
    queued_copies_.push_back(QueuedCopy{StateCopy{static_cast<std::int32_t>(g), seq.states[g].working, slot}, seq.id});
  }
}

void KVCacheManager::TakeStateCopies(std::vector<StateCopy>* after) {
  std::lock_guard<std::mutex> lock(mu_);
  after->clear();
  for (const QueuedCopy& q : queued_copies_) after->push_back(q.copy);
  MarkCopiesDone();
}

std::int64_t KVCacheManager::SaveCheckpoints() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const QueuedCopy& q : queued_copies_) CopySlot(static_cast<std::size_t>(q.copy.group), q.copy.src, q.copy.dst);
  const auto n = static_cast<std::int64_t>(queued_copies_.size());
  MarkCopiesDone();
  return n;
}

void KVCacheManager::MarkCopiesDone() {
  for (const QueuedCopy& q : queued_copies_) {
    Sequence& seq = Find(q.seq);
    for (PendingCheckpoint& c : seq.states[static_cast<std::size_t>(q.copy.group)].pending) {
      if (c.slot == q.copy.dst) c.ready = true;
    }
  }
  queued_copies_.clear();
}

void KVCacheManager::DropQueuedCopies(SeqId id) {
  queued_copies_.erase(std::remove_if(queued_copies_.begin(), queued_copies_.end(),
                                      [id](const QueuedCopy& q) { return q.seq == id; }),
                       queued_copies_.end());
}

NodeId KVCacheManager::NodeAtDepth(const Sequence& seq, std::int32_t key_len, std::int32_t depth) const {
  NodeId node = ReuseTree::kRoot;
  std::uint64_t hash = 0;
  for (std::int32_t d = 0; d < depth && node != kNoNode; ++d) {
    std::int32_t len = 0;
    std::uint64_t digest = 0;
    hash = ChainKey(seq, key_len, d, hash, &len, &digest);
    if (len != tpb_) return kNoNode;
    node = tree_->FindChild(node, hash, seq.TokenData() + static_cast<std::ptrdiff_t>(d) * tpb_, len, digest);
  }
  return node;
}

void KVCacheManager::StoreCheckpoints(Sequence& seq, std::int32_t key_len, bool all) {
  if (states_.empty()) return;
  // Shallowest first, so that a per-path cap sees the shallower ones when a deeper one joins.
  std::vector<PendingCheckpoint>& first = seq.states[0].pending;
  for (std::size_t k = 0; k < first.size();) {
    const PendingCheckpoint c = first[k];
    const NodeId node =
        (all || !c.rolling) && c.ready && c.position <= key_len ? NodeAtDepth(seq, key_len, c.position / tpb_) : kNoNode;
    if (node == kNoNode && !all) {
      ++k;
      continue;
    }
    for (std::size_t g = 0; g < states_.size(); ++g) {
      StatePool& pool = *states_[g];
      const SlotId slot = seq.states[g].pending[k].slot;
      if (node == kNoNode) {
        pool.Free(slot);
      } else if (pool.CheckpointAt(node) == kNoSlot) {
        pool.Cache(slot, node, seq.priority, checkpoint_policy_.max_per_path, seq.extras.lora_task_id);
      } else {
        pool.Free(slot);  // another sequence stored this prefix's state first
        pool.Touch(pool.CheckpointAt(node), /*hit=*/false);
      }
      seq.states[g].pending.erase(seq.states[g].pending.begin() + static_cast<std::ptrdiff_t>(k));
    }
    if (node == kNoNode) {
      ++state_counters_.skipped;
    } else {
      ++state_counters_.stored;
    }
  }
}

void KVCacheManager::ReleaseState(Sequence& seq) {
  if (states_.empty()) return;
  DropQueuedCopies(seq.id);
  for (std::size_t g = 0; g < states_.size(); ++g) {
    SequenceState& st = seq.states[g];
    for (const PendingCheckpoint& c : st.pending) states_[g]->Free(c.slot);
    if (g == 0) state_counters_.skipped += static_cast<std::int64_t>(st.pending.size());
    st.pending.clear();
    if (st.working != kNoSlot) states_[g]->Free(st.working);
    st.working = kNoSlot;
  }
}

void KVCacheManager::ForkState(const Sequence& parent, Sequence& child) {
  if (states_.empty()) return;
  child.states.assign(states_.size(), SequenceState{});
  child.checkpoint_plan.clear();
  for (std::size_t g = 0; g < states_.size(); ++g) {
    const SlotId working = states_[g]->Take(/*pending=*/false);
    KVC_CHECK(working != kNoSlot, "no state slot for a forked sequence (max_batch_size reserve broken)");
    child.states[g].working = working;
    CopySlot(g, parent.states[g].working, working);
  }
}

std::int32_t KVCacheManager::ChunkLimitOf(const std::vector<std::int32_t>& plan, std::int32_t from,
                                          std::int32_t num_tokens, std::int32_t prompt_len) const {
  std::int32_t limit = num_tokens;
  for (const std::int32_t p : plan) {
    if (p > from) {
      limit = std::min(num_tokens, p - from);
      break;
    }
  }
  // chunk_end (vLLM's align mode): a chunk that does not end the prompt ends on a boundary.
  if (checkpoint_policy_.chunk_end && reuse_ && !states_.empty() && from + limit < prompt_len) {
    const std::int32_t aligned = (from + limit) / tpb_ * tpb_;
    if (aligned > from) limit = aligned - from;
  }
  return limit;
}

std::int32_t KVCacheManager::GetChunkLimit(SeqId id, std::int32_t num_tokens) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& seq = Find(id);
  if (num_tokens < 1) ThrowInvalid("get_chunk_limit: num_tokens must be >= 1, got ", num_tokens);
  return ChunkLimitOf(seq.checkpoint_plan, seq.num_tokens, num_tokens, seq.prompt_len);
}

std::int32_t KVCacheManager::GetPromptChunkLimit(const PreparedPrompt& prompt, std::int32_t num_tokens) const {
  std::lock_guard<std::mutex> lock(mu_);
  CheckPrepared(prompt);
  if (num_tokens < 1) ThrowInvalid("get_prompt_chunk_limit: num_tokens must be >= 1, got ", num_tokens);
  if (states_.empty()) return num_tokens;
  const ReusePlan& plan = PlanReuse(prompt.tokens.data(), prompt.tokens.size(), prompt.extras, &prompt);
  std::vector<std::int32_t> positions;
  PlanCheckpoints(static_cast<std::int32_t>(prompt.tokens.size()), plan.reused_tokens, plan.attention_blocks, &positions);
  return ChunkLimitOf(positions, plan.reused_tokens, num_tokens, static_cast<std::int32_t>(prompt.tokens.size()));
}

ReusableByKind KVCacheManager::GetReusableByKind(const PreparedPrompt& prompt) const {
  std::lock_guard<std::mutex> lock(mu_);
  CheckPrepared(prompt);
  const ReusePlan& plan = PlanReuse(prompt.tokens.data(), prompt.tokens.size(), prompt.extras, &prompt);
  ReusableByKind r;
  r.matched = static_cast<std::int32_t>(plan.path.size()) * tpb_;
  r.full_attention = plan.full_attention_blocks * tpb_;
  r.sliding_window = plan.attention_blocks * tpb_;
  r.recurrent_state = states_.empty() ? r.sliding_window : plan.full_blocks * tpb_;
  r.reused = plan.reused_tokens;
  return r;
}

std::int32_t KVCacheManager::RewindCheckpoint(const Sequence& seq, std::int32_t new_len) const {
  if (states_.empty() || new_len == seq.num_tokens) return -1;  // dropping nothing restores nothing
  const std::vector<PendingCheckpoint>& first = seq.states[0].pending;
  for (std::size_t k = 0; k < first.size(); ++k) {
    if (first[k].ready && first[k].position == new_len) return static_cast<std::int32_t>(k);
  }
  ThrowInvalid("rewind: request ", seq.id, " has recurrent layers, whose state is updated in place and cannot go back ",
               "to ", new_len, " tokens without a checkpoint taken there (the sequence holds none; speculative "
               "decoding on recurrent layers needs per-token states, which kvcache does not keep)");
}

void KVCacheManager::RewindState(Sequence& seq, std::int32_t k) {
  if (k < 0) return;
  const std::int32_t position = seq.states[0].pending[static_cast<std::size_t>(k)].position;
  DropQueuedCopies(seq.id);  // copies of checkpoints past the rewind are void
  for (std::size_t g = 0; g < states_.size(); ++g) {
    SequenceState& st = seq.states[g];
    CopySlot(g, st.pending[static_cast<std::size_t>(k)].slot, st.working);
    for (std::size_t i = st.pending.size(); i-- > 0;) {
      if (st.pending[i].position > position || !st.pending[i].ready) {
        states_[g]->Free(st.pending[i].slot);
        st.pending.erase(st.pending.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
  }
}

void KVCacheManager::CountLostHits(const ReusePlan& plan) {
  const auto matched = static_cast<std::int64_t>(plan.path.size());
  state_counters_.lost_attention += (matched - plan.full_attention_blocks) * tpb_;
  state_counters_.lost_sliding += static_cast<std::int64_t>(plan.full_attention_blocks - plan.attention_blocks) * tpb_;
  if (!states_.empty()) {
    state_counters_.lost_checkpoint += static_cast<std::int64_t>(plan.attention_blocks - plan.full_blocks) * tpb_;
  }
}

void KVCacheManager::CheckStateInvariants() const {
  for (std::size_t g = 0; g < states_.size(); ++g) {
    std::int64_t working = 0;
    std::int64_t pending = 0;
    for (const auto& [id, seq] : sequences_) {
      KVC_CHECK(seq.states.size() == states_.size(), detail::Concat("request ", id, ": state groups missing"));
      const SequenceState& st = seq.states[g];
      KVC_CHECK(st.working != kNoSlot, detail::Concat("request ", id, ": no working state slot"));
      ++working;
      KVC_CHECK(st.pending.size() == seq.states[0].pending.size(),
                detail::Concat("request ", id, ": state groups disagree on pending checkpoints"));
      for (std::size_t k = 0; k < st.pending.size(); ++k) {
        const PendingCheckpoint& c = st.pending[k];
        KVC_CHECK(c.position == seq.states[0].pending[k].position && c.position % tpb_ == 0 &&
                      c.position <= seq.num_tokens,
                  detail::Concat("request ", id, ": pending checkpoint at ", c.position, " for ", seq.num_tokens, " tokens"));
      }
      pending += static_cast<std::int64_t>(st.pending.size());
    }
    states_[g]->CheckInvariants(working, pending, 0);
  }
  for (const QueuedCopy& q : queued_copies_) {
    KVC_CHECK(sequences_.count(q.seq) != 0, detail::Concat("a queued state copy of request ", q.seq, ", which has ended"));
  }
  KVC_CHECK(StateSlack(0, sequences_.size()), "state groups keep fewer free slots than unregistered sequences may take");
}

}  // namespace kvcache
