#include "kvcache/state_pool.h"

#include <algorithm>
#include <limits>

#include "kvcache/errors.h"

namespace kvcache {

std::size_t StateTensorSpec::Bytes() const {
  std::size_t n = static_cast<std::size_t>(DTypeBytes(dtype));
  for (const std::int64_t d : shape) n *= static_cast<std::size_t>(d);
  return n;
}

std::vector<StateGroupLayout> PlanStateGroups(const std::vector<std::vector<StateTensorSpec>>& layers) {
  std::vector<StateGroupLayout> groups;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const std::vector<StateTensorSpec>& tensors = layers[l];
    if (tensors.empty()) ThrowInvalid("recurrent layer ", l, " declares no state tensors");
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      if (tensors[t].shape.empty() || tensors[t].shape.size() > 4) {
        ThrowInvalid("recurrent layer ", l, ", state tensor ", t, ": a shape needs 1 to 4 dimensions, got ",
                     tensors[t].shape.size());
      }
      for (const std::int64_t d : tensors[t].shape) {
        if (d <= 0 || d > std::numeric_limits<std::int32_t>::max()) {
          ThrowInvalid("recurrent layer ", l, ", state tensor ", t, ": dimensions must be positive, got ", d);
        }
      }
    }
    auto it = std::find_if(groups.begin(), groups.end(), [&](const StateGroupLayout& g) { return g.tensors == tensors; });
    if (it == groups.end()) {
      StateGroupLayout g;
      g.tensors = tensors;
      for (const StateTensorSpec& t : tensors) {
        g.tensor_offsets.push_back(g.layer_bytes);
        g.layer_bytes += t.Bytes();
      }
      groups.push_back(std::move(g));
      it = groups.end() - 1;
    }
    it->layers.push_back(static_cast<std::int32_t>(l));
  }
  for (StateGroupLayout& g : groups) g.slot_bytes = g.layer_bytes * g.layers.size();
  return groups;
}

StatePool::StatePool(StateGroupLayout layout, std::int32_t group, std::int32_t num_slots, std::int32_t num_secondary,
                     MemoryBackend* backend, ReuseTree* tree, std::int32_t column, EventLog* events)
    : layout_(std::move(layout)), group_(group), backend_(backend), tree_(tree), column_(column), events_(events) {
  if (num_slots <= 0) ThrowInvalid("state group ", group, " needs at least one slot, got ", num_slots);
  if (num_secondary < 0) ThrowInvalid("state group ", group, ": negative secondary slot count ", num_secondary);
  if (static_cast<std::int64_t>(num_slots) + num_secondary > std::numeric_limits<std::int32_t>::max()) {
    ThrowInvalid("state group ", group, ": primary and secondary slots exceed 2**31 - 1 slot ids");
  }
  num_primary_ = num_slots;
  if (backend_->HasMemory()) {
    memory_ = backend_->Allocate(CacheLevel::kPrimary, layout_.slot_bytes * static_cast<std::size_t>(num_slots));
    if (num_secondary > 0) {
      try {
        host_ = backend_->Allocate(CacheLevel::kSecondary, layout_.slot_bytes * static_cast<std::size_t>(num_secondary));
      } catch (...) {
        backend_->Free(CacheLevel::kPrimary, memory_);
        throw;
      }
    }
  }
  slots_.resize(static_cast<std::size_t>(num_slots) + static_cast<std::size_t>(num_secondary));
  free_.reserve(static_cast<std::size_t>(num_slots));
  for (SlotId s = num_slots; s-- > 0;) free_.push_back(s);  // slot 0 is taken first
  for (SlotId s = num_slots + num_secondary; s-- > num_slots;) free_secondary_.push_back(s);
}

StatePool::~StatePool() {
  if (memory_ != nullptr) backend_->Free(CacheLevel::kPrimary, memory_);
  if (host_ != nullptr) backend_->Free(CacheLevel::kSecondary, host_);
}

void* StatePool::Address(SlotId s) const {
  void* base = IsSecondary(s) ? host_ : memory_;
  if (base == nullptr) return nullptr;
  const auto index = static_cast<std::size_t>(IsSecondary(s) ? s - num_primary_ : s);
  return static_cast<unsigned char*>(base) + index * layout_.slot_bytes;
}

SlotId StatePool::Take(bool pending) {
  SlotId s = kNoSlot;
  if (!free_.empty()) {
    s = free_.back();
    free_.pop_back();
  } else if (!evictable_.empty()) {
    s = std::get<3>(*evictable_.begin());
    Evict(s);
    KVC_CHECK(!free_.empty() && free_.back() == s, "an evicted checkpoint's slot was not freed");
    free_.pop_back();
  } else {
    return kNoSlot;
  }
  Slot& slot = slots_[s];
  slot.state = pending ? State::kPending : State::kWorking;
  ++(pending ? num_pending_ : num_working_);
  return s;
}

void StatePool::Free(SlotId s) {
  Slot& slot = slots_[s];
  KVC_CHECK(slot.state == State::kWorking || slot.state == State::kPending, "freeing a slot that is not live");
  --(slot.state == State::kPending ? num_pending_ : num_working_);
  slot = Slot{};
  free_.push_back(s);
}

void StatePool::Cache(SlotId s, NodeId node, int priority, std::int32_t max_per_path,
                      std::optional<std::int64_t> lora_task_id) {
  Slot& slot = slots_[s];
  KVC_CHECK(slot.state == State::kPending && tree_->Block(node, column_) == kNullBlock, "caching a checkpoint twice");
  --num_pending_;
  ++num_cached_;
  slot.state = State::kCached;
  slot.node = node;
  slot.priority = priority;
  slot.stamp = ++clock_;
  tree_->SetBlock(node, column_, s);
  evictable_.insert(KeyOf(s));
  if (events_ != nullptr) {
    KVCacheEvent e;
    e.kind = EventKind::kStored;
    e.state_group = group_;
    const NodeId parent = tree_->Parent(node);
    if (parent != ReuseTree::kRoot) e.parent_hash = tree_->Hash(parent);
    StoredBlock b;
    b.hash = tree_->Hash(node);
    b.tokens.assign(tree_->Tokens(node), tree_->Tokens(node) + tree_->NumTokens(node));
    b.lora_task_id = lora_task_id;
    b.priority = priority;
    e.blocks.push_back(std::move(b));
    events_->Push(std::move(e));
  }
  if (max_per_path <= 0) return;
  std::int32_t on_path = 0;
  SlotId shallowest = kNoSlot;
  for (NodeId n = node; n != ReuseTree::kRoot; n = tree_->Parent(n)) {
    const SlotId c = tree_->Block(n, column_);
    if (c == kNullBlock) continue;
    ++on_path;
    if (slots_[c].holds == 0 && c != s) shallowest = c;
  }
  if (on_path > max_per_path && shallowest != kNoSlot) Drop(shallowest);
}

void StatePool::Touch(SlotId s, bool hit) {
  Slot& slot = slots_[s];
  if (slot.holds == 0) Evictable(s).erase(KeyOf(s));
  slot.stamp = ++clock_;
  slot.hit = slot.hit || hit;
  if (slot.holds == 0) Evictable(s).insert(KeyOf(s));
}

void StatePool::Hold(SlotId s) {
  Slot& slot = slots_[s];
  KVC_CHECK(slot.state == State::kCached, "holding a slot that is not a checkpoint");
  if (slot.holds++ == 0) Evictable(s).erase(KeyOf(s));
}

void StatePool::Unhold(SlotId s) {
  Slot& slot = slots_[s];
  KVC_CHECK(slot.holds > 0, "letting go of a checkpoint that is not held");
  if (--slot.holds == 0) Evictable(s).insert(KeyOf(s));
}

void StatePool::Evict(SlotId s) {
  KVC_CHECK(slots_[s].state == State::kCached && slots_[s].holds == 0, "evicting a checkpoint in use");
  if (IsSecondary(s) || num_secondary() == 0) {
    Drop(s);
    return;
  }
  // Offload: a free host slot, else the host's least valuable checkpoint makes room.
  if (free_secondary_.empty()) {
    if (evictable_secondary_.empty()) {
      Drop(s);
      return;
    }
    Drop(std::get<3>(*evictable_secondary_.begin()));
  }
  const SlotId h = free_secondary_.back();
  free_secondary_.pop_back();
  if (memory_ != nullptr) {
    const std::size_t bytes = layout_.slot_bytes;
    backend_->Copy2D(Address(h), CacheLevel::kSecondary, bytes, Address(s), CacheLevel::kPrimary, bytes, bytes, 1);
    backend_->Synchronize();
  }
  Slot& slot = slots_[s];
  evictable_.erase(KeyOf(s));
  slots_[h] = slot;
  tree_->SetBlock(slot.node, column_, h);
  evictable_secondary_.insert(KeyOf(h));
  --num_cached_;
  ++num_cached_secondary_;
  ++offloaded_;
  if (events_ != nullptr) {
    KVCacheEvent e;
    e.kind = EventKind::kUpdated;
    e.state_group = group_;
    e.hash = tree_->Hash(slot.node);
    e.cache_level = std::make_pair(0, 1);
    events_->Push(std::move(e));
  }
  slot = Slot{};
  free_.push_back(s);
}

void StatePool::Drop(SlotId s) {
  Slot& slot = slots_[s];
  Evictable(s).erase(KeyOf(s));
  const NodeId node = slot.node;
  if (events_ != nullptr) events_->PushRemoved(0, tree_->Hash(node), group_);
  tree_->SetBlock(node, column_, kNullBlock);
  if (tree_->IsEmpty(node) && tree_->IsLeaf(node)) tree_->PruneUp(node);
  --(IsSecondary(s) ? num_cached_secondary_ : num_cached_);
  ++evicted_;
  slot = Slot{};
  (IsSecondary(s) ? free_secondary_ : free_).push_back(s);
}

std::int64_t StatePool::DropAll() {
  std::int64_t n = 0;
  for (std::set<Key>* set : {&evictable_, &evictable_secondary_}) {
    while (!set->empty()) {
      Drop(std::get<3>(*set->begin()));
      ++n;
    }
  }
  return n;
}

void StatePool::CheckInvariants(std::int64_t expected_working, std::int64_t expected_pending,
                                std::int64_t expected_holds) const {
  std::int64_t working = 0;
  std::int64_t pending = 0;
  std::int64_t cached[2] = {0, 0};
  std::int64_t unheld[2] = {0, 0};
  std::int64_t holds = 0;
  std::vector<char> is_free(slots_.size(), 0);
  for (const std::vector<SlotId>* list : {&free_, &free_secondary_}) {
    for (const SlotId s : *list) {
      KVC_CHECK(is_free[static_cast<std::size_t>(s)] == 0,
                detail::Concat("state group ", group_, ": slot ", s, " freed twice"));
      KVC_CHECK((list == &free_secondary_) == IsSecondary(s),
                detail::Concat("state group ", group_, ": slot ", s, " in the other level's free list"));
      is_free[static_cast<std::size_t>(s)] = 1;
    }
  }
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const Slot& slot = slots_[i];
    const auto s = static_cast<SlotId>(i);
    const int level = IsSecondary(s) ? 1 : 0;
    KVC_CHECK((slot.state == State::kFree) == (is_free[i] != 0),
              detail::Concat("state group ", group_, ": slot ", s, " is free but not in the free list, or the reverse"));
    KVC_CHECK(level == 0 || slot.state == State::kFree || slot.state == State::kCached,
              detail::Concat("state group ", group_, ": host slot ", s, " is a working or pending slot"));
    switch (slot.state) {
      case State::kFree:
        break;
      case State::kWorking:
        ++working;
        break;
      case State::kPending:
        ++pending;
        break;
      case State::kCached:
        ++cached[level];
        holds += slot.holds;
        KVC_CHECK(tree_->Alive(slot.node) && tree_->Block(slot.node, column_) == s,
                  detail::Concat("state group ", group_, ": checkpoint slot ", s, " is not at its tree node"));
        KVC_CHECK((Evictable(s).count(KeyOf(s)) != 0) == (slot.holds == 0),
                  detail::Concat("state group ", group_, ": checkpoint slot ", s, " evictable set disagrees with its holds"));
        if (slot.holds == 0) ++unheld[level];
        break;
    }
  }
  KVC_CHECK(working == num_working_ && working == expected_working,
            detail::Concat("state group ", group_, ": ", working, " working slots, sequences hold ", expected_working));
  KVC_CHECK(pending == num_pending_ && pending == expected_pending,
            detail::Concat("state group ", group_, ": ", pending, " pending checkpoints, sequences hold ", expected_pending));
  KVC_CHECK(cached[0] == num_cached_ && cached[1] == num_cached_secondary_,
            detail::Concat("state group ", group_, ": cached count drifted"));
  KVC_CHECK(holds == expected_holds, detail::Concat("state group ", group_, ": ", holds, " holds, expected ",
                                                    expected_holds));
  KVC_CHECK(static_cast<std::size_t>(unheld[0]) == evictable_.size() &&
                static_cast<std::size_t>(unheld[1]) == evictable_secondary_.size(),
            detail::Concat("state group ", group_, ": stale LRU entries"));
}

}  // namespace kvcache
