#include "kvcache/window_block_manager.h"

#include <algorithm>
#include <utility>

#include "kvcache/errors.h"

namespace kvcache {

WindowBlockManager::WindowBlockManager(WindowSize window, bool is_swa, std::int32_t window_index,
                                       std::vector<PoolLayout> pools, std::int32_t num_primary,
                                       std::int32_t num_secondary, MemoryBackend* backend,
                                       ReuseTree* tree, WindowReuseOptions options,
                                       EventLog* events, const SharedPrimary* shared)
    : window_(window),
      is_swa_(is_swa),
      index_(window_index),
      pools_(std::move(pools)),
      num_primary_(num_primary),
      num_secondary_(num_secondary),
      backend_(backend),
      tree_(tree),
      options_(options),
      events_(events),
      policy_(num_primary, num_secondary, options.protected_fraction, shared != nullptr ? shared->blocks_per_slab : 0) {
  const auto total = static_cast<std::size_t>(num_primary + num_secondary);
  state_.assign(total, BlockState{});
  more_releasers_.assign(total, {});
  primary_.assign(pools_.size(), nullptr);
  primary_stride_.assign(pools_.size(), 0);
  secondary_.assign(pools_.size(), nullptr);
  BlockId first_owned = 0;
  BlockId end_owned = num_primary;
  if (shared != nullptr) {
    KVC_CHECK(shared->blocks_per_slab > 0 && num_primary == shared->num_slabs * shared->blocks_per_slab &&
                  shared->pool_offsets.size() == pools_.size() && shared->first_slab >= 0 &&
                  shared->first_slab + shared->owned_slabs <= shared->num_slabs,
              "shared primary memory does not match the window");
    own_primary_ = false;
    slab_blocks_ = shared->blocks_per_slab;
    slab_owned_.assign(static_cast<std::size_t>(shared->num_slabs), 0);
    for (std::int32_t k = shared->first_slab; k < shared->first_slab + shared->owned_slabs; ++k) {
      slab_owned_[static_cast<std::size_t>(k)] = 1;
    }
    first_owned = shared->first_slab * slab_blocks_;
    end_owned = first_owned + shared->owned_slabs * slab_blocks_;
    for (std::size_t p = 0; p < pools_.size(); ++p) {
      primary_[p] = shared->base == nullptr ? nullptr : shared->base + shared->pool_offsets[p];
      primary_stride_[p] = shared->block_stride;
    }
  }
  owned_primary_ = end_owned - first_owned;
  policy_.SetLevelSize(CacheLevel::kPrimary, owned_primary_);
  try {
    for (std::size_t p = 0; p < pools_.size(); ++p) {
      const std::size_t block_bytes = pools_[p].BlockBytes();
      if (own_primary_) {
        const std::size_t primary_bytes = block_bytes * static_cast<std::size_t>(num_primary);
        primary_[p] = backend_->Allocate(CacheLevel::kPrimary, primary_bytes);
        primary_stride_[p] = block_bytes;
        if (backend_->HasMemory()) allocated_bytes_ += primary_bytes;
      }
      const std::size_t secondary_bytes = block_bytes * static_cast<std::size_t>(num_secondary);
      if (secondary_bytes > 0) {
        secondary_[p] = backend_->Allocate(CacheLevel::kSecondary, secondary_bytes);
        if (backend_->HasMemory()) allocated_bytes_ += secondary_bytes;
      }
    }
  } catch (...) {
    for (std::size_t p = 0; p < pools_.size(); ++p) {
      if (own_primary_) backend_->Free(CacheLevel::kPrimary, primary_[p]);
      backend_->Free(CacheLevel::kSecondary, secondary_[p]);
    }
    throw;
  }
  // Every owned block starts free and empty, in id order.
  for (BlockId b = first_owned; b < end_owned; ++b) policy_.Push(b, EvictionPolicy::kScratch);
  for (BlockId b = num_primary; b < num_primary + num_secondary; ++b) policy_.Push(b, EvictionPolicy::kScratch);
}

WindowBlockManager::~WindowBlockManager() {
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    if (own_primary_) backend_->Free(CacheLevel::kPrimary, primary_[p]);
    backend_->Free(CacheLevel::kSecondary, secondary_[p]);
  }
}

unsigned char* WindowBlockManager::Address(BlockId b, std::size_t pool) const {
  if (IsPrimary(b)) return static_cast<unsigned char*>(primary_[pool]) + static_cast<std::size_t>(b) * primary_stride_[pool];
  const std::size_t bytes = pools_[pool].BlockBytes();
  return static_cast<unsigned char*>(secondary_[pool]) + static_cast<std::size_t>(b - num_primary_) * bytes;
}

int WindowBlockManager::QueuePriority(BlockId b) const {
  return state_[b].node != kNoNode ? state_[b].priority : EvictionPolicy::kScratch;
}

bool WindowBlockManager::QueueProtected(BlockId b) const {
  return options_.protect_hit_blocks && state_[b].hit && state_[b].node != kNoNode;
}

inline void WindowBlockManager::Enqueue(BlockId b, bool to_front) {
  // Every caller's block is out of the queues (just freed, or removed to move it).
  KVC_DCHECK(!policy_.Contains(b), "enqueue of a queued block");
  BlockId demoted = kNullBlock;
  if (state_[b].node == kNoNode) {
    policy_.PushScratch(b, to_front);  // holds nothing reusable
  } else {
    demoted = policy_.Push(b, state_[b].priority, /*to_front=*/false, QueueProtected(b));
  }
  if (clock_ != nullptr && IsPrimary(b)) stamp_[static_cast<std::size_t>(b)] = ++*clock_;
  if (demoted != kNullBlock) {
    state_[demoted].hit = false;
    if (clock_ != nullptr && IsPrimary(demoted)) stamp_[static_cast<std::size_t>(demoted)] = ++*clock_;  // at the back now
  }
}

void WindowBlockManager::EnableEvictionKeys(std::uint64_t* clock) {
  KVC_CHECK(clock != nullptr, "eviction keys need a clock");
  clock_ = clock;
  stamp_.assign(static_cast<std::size_t>(num_primary_), 0);
  // Blocks queued already get stamps in hand-out order, so their keys keep the queues' order.
  policy_.ForEach(CacheLevel::kPrimary, [&](BlockId b) { stamp_[static_cast<std::size_t>(b)] = ++*clock_; });
}

WindowBlockManager::EvictionKey WindowBlockManager::EvictionKeyOf(BlockId b) const {
  const int priority = QueuePriority(b);
  if (priority == EvictionPolicy::kScratch) return EvictionKey{-1, 0};
  return EvictionKey{2 * priority + (QueueProtected(b) ? 1 : 0),
                     stamp_.empty() ? 0 : stamp_[static_cast<std::size_t>(b)]};
}

std::int32_t WindowBlockManager::CheaperSlab(const EvictionKey& than) const {
  const BlockId victim = policy_.Peek(CacheLevel::kPrimary);
  if (slab_blocks_ == 0 || victim == kNullBlock || !(EvictionKeyOf(victim) < than)) return -1;
  const std::int32_t slab = victim / slab_blocks_;
  if (!policy_.SlabListed(slab)) return -1;
  for (BlockId b = slab * slab_blocks_; b < (slab + 1) * slab_blocks_; ++b) {
    if (!(EvictionKeyOf(b) < than)) return -1;
  }
  return slab;
}

void WindowBlockManager::Requeue(BlockId b) {
  policy_.Remove(b);
  Enqueue(b);
}

void WindowBlockManager::MarkHit(BlockId b) {
  if (state_[b].hit || state_[b].node == kNoNode) return;
  state_[b].hit = true;
  if (InPolicy(b)) Requeue(b);
}

void WindowBlockManager::EmitUpdated(BlockId b, std::optional<std::pair<int, int>> level,
                                     std::optional<std::pair<int, int>> priority) {
  if (events_ == nullptr || state_[b].node == kNoNode) return;
  KVCacheEvent e;
  e.kind = EventKind::kUpdated;
  e.window_size = window_;
  e.hash = tree_->Hash(state_[b].node);
  e.cache_level = level;
  e.priority = priority;
  events_->Push(std::move(e));
}

inline void WindowBlockManager::Renew(BlockId b, std::vector<SeqId>* displaced) {
  BlockState& s = state_[b];
  if (s.releaser >= 0) {
    displaced->push_back(s.releaser);
    std::vector<SeqId>& more = more_releasers_[b];
    displaced->insert(displaced->end(), more.begin(), more.end());
    more.clear();
    s.releaser = -1;
  }
  s.hit = false;
  ++s.generation;
}

inline void WindowBlockManager::Hand(BlockId b, int priority, std::int64_t expiry_ms) {
  BlockState& s = state_[b];
  s.ref_count = 1;
  s.priority = static_cast<std::int8_t>(priority);
  if (s.expiry_ms == 0 && expiry_ms != 0) timed_.push_back(b);
  s.expiry_ms = expiry_ms;
}

inline void WindowBlockManager::Reclaim(BlockId b, bool offload, std::vector<SeqId>* displaced) {
  policy_.Remove(b);
  if (state_[b].node != kNoNode) {
    if (offload) {
      EvictCached(b);
    } else {
      Drop(b);
    }
  }
  Renew(b, displaced);
}

BlockId WindowBlockManager::Grant(BlockId b, int priority, std::int64_t expiry_ms, bool offload,
                                  std::vector<SeqId>* displaced) {
  KVC_CHECK(IsPrimary(b) && state_[b].ref_count == 0 && Owns(b),
            detail::Concat("window ", window_, ": grant of block ", b, " which is not a free primary block"));
  Reclaim(b, offload, displaced);
  Hand(b, priority, expiry_ms);
  return b;
}

std::int32_t WindowBlockManager::SlabToLend(const std::vector<BlockId>* keep) const {
  KVC_CHECK(slab_blocks_ > 0, "lending needs slabs");
  auto kept = [&](std::int32_t s) {
    if (keep == nullptr) return false;
    for (const BlockId b : *keep) {
      if (b != kNullBlock && IsPrimary(b) && b / slab_blocks_ == s) return true;
    }
    return false;
  };
  const BlockId victim = policy_.Peek(CacheLevel::kPrimary);
  std::int32_t slab = victim == kNullBlock ? -1 : victim / slab_blocks_;
  if (slab < 0 || !policy_.SlabListed(slab) || kept(slab)) {
    slab = policy_.OldestFreeSlab();
    while (slab >= 0 && kept(slab)) slab = policy_.NextFreeSlab(slab);
  }
  KVC_CHECK(slab >= 0, detail::Concat("window ", window_, " has no wholly free slab to lend"));
  return slab;
}

void WindowBlockManager::LendSlab(std::int32_t slab, std::vector<SeqId>* displaced) {
  KVC_CHECK(slab_blocks_ > 0 && slab >= 0 && OwnsSlab(slab) && policy_.SlabListed(slab),
            detail::Concat("window ", window_, ": slab ", slab, " is not wholly free"));
  const BlockId first = slab * slab_blocks_;
  for (BlockId b = first; b < first + slab_blocks_; ++b) {
    // Evicting one block may unlink (and re-queue) others of the slab below it: still free.
    Reclaim(b, /*offload=*/true, displaced);
    state_[b].priority = static_cast<std::int8_t>(kDefaultPriority);
    state_[b].expiry_ms = 0;
  }
  slab_owned_[static_cast<std::size_t>(slab)] = 0;
  owned_primary_ -= slab_blocks_;
  policy_.SetLevelSize(CacheLevel::kPrimary, owned_primary_);
}

void WindowBlockManager::AdoptSlab(std::int32_t slab) {
  KVC_CHECK(slab_blocks_ > 0 && slab >= 0 && static_cast<std::size_t>(slab) < slab_owned_.size() && !OwnsSlab(slab),
            detail::Concat("window ", window_, ": cannot adopt slab ", slab));
  slab_owned_[static_cast<std::size_t>(slab)] = 1;
  owned_primary_ += slab_blocks_;
  policy_.SetLevelSize(CacheLevel::kPrimary, owned_primary_);
  const BlockId first = slab * slab_blocks_;
  for (BlockId b = first; b < first + slab_blocks_; ++b) policy_.Push(b, EvictionPolicy::kScratch);
}

inline BlockId WindowBlockManager::TakeVictim(int priority, std::int64_t expiry_ms, std::vector<SeqId>* displaced) {
  // Grant(victim, offload=true) without its checks: the victim is a free primary block of this
  // window by construction.
  const BlockId b = policy_.Peek(CacheLevel::kPrimary);
  KVC_CHECK(b != kNullBlock, detail::Concat("window ", window_, " has no free block to hand out"));
  KVC_DCHECK(state_[b].ref_count == 0 && Owns(b), "victim is not a free block of the window");
  if (state_[b].node != kNoNode) ++cached_evictions_;
  Reclaim(b, /*offload=*/true, displaced);
  Hand(b, priority, expiry_ms);
  return b;
}

BlockId WindowBlockManager::Acquire(int priority, std::int64_t expiry_ms, std::vector<SeqId>* displaced) {
  return TakeVictim(priority, expiry_ms, displaced);
}

void WindowBlockManager::AcquireN(std::int32_t n, int priority, std::int64_t expiry_ms, BlockId* out,
                                  std::vector<SeqId>* displaced) {
  KVC_CHECK(n >= 0 && n <= policy_.NumFree(CacheLevel::kPrimary),
            detail::Concat("window ", window_, " has ", policy_.NumFree(CacheLevel::kPrimary),
                           " free blocks, cannot hand out ", n));
  // Scratch blocks first, in one pass: they hold nothing to evict, so Grant reduces to a new
  // generation and the hand-out (Reclaim's other work has nothing to do).
  const std::int32_t k = policy_.PopScratch(CacheLevel::kPrimary, n, out);
  for (std::int32_t i = 0; i < k; ++i) {
    const BlockId b = out[i];
    KVC_DCHECK(state_[b].node == kNoNode && state_[b].ref_count == 0 && Owns(b), "scratch block in use or cached");
    Renew(b, displaced);
    Hand(b, priority, expiry_ms);
  }
  // Then cached victims one by one: an eviction may turn other blocks into scratch blocks,
  // which go first.
  for (std::int32_t i = k; i < n; ++i) out[i] = TakeVictim(priority, expiry_ms, displaced);
}

void WindowBlockManager::EvictCached(BlockId victim) {
  const bool offload = options_.onboard_blocks && num_secondary_ > 0 &&
                       state_[victim].priority >= options_.secondary_offload_min_priority &&
                       policy_.NumFree(CacheLevel::kSecondary) > 0;
  if (!offload) {
    Drop(victim);
    return;
  }
  const BlockId s = policy_.Peek(CacheLevel::kSecondary);
  policy_.Remove(s);
  // The oldest offloaded content goes to the disk tier, or is dropped; may unlink victim.
  if (state_[s].node != kNoNode && !SpillToDisk(s)) Drop(s);
  if (state_[victim].node == kNoNode) {
    policy_.Push(s, EvictionPolicy::kScratch);
    return;
  }
  if (backend_->HasMemory()) {
    for (std::size_t p = 0; p < pools_.size(); ++p) {
      const std::size_t bytes = pools_[p].BlockBytes();
      backend_->Copy2D(Address(s, p), CacheLevel::kSecondary, bytes, Address(victim, p), CacheLevel::kPrimary,
                       bytes, bytes, 1);
    }
  }
  const NodeId n = state_[victim].node;
  tree_->SetBlock(n, index_, s);
  state_[s].node = n;
  state_[victim].node = kNoNode;
  state_[s].priority = state_[victim].priority;
  state_[s].hit = state_[victim].hit;
  state_[victim].hit = false;
  if (state_[s].expiry_ms == 0 && state_[victim].expiry_ms != 0) timed_.push_back(s);
  state_[s].expiry_ms = state_[victim].expiry_ms;
  Enqueue(s);
  ++offloaded_;
  EmitUpdated(s, std::make_pair(0, 1), std::nullopt);
}

void WindowBlockManager::Claim(BlockId b) {
  if (state_[b].ref_count == 0) {
    if (IsDisk(b)) {
      DiskUnqueue(b);
    } else {
      policy_.Remove(b);
    }
  }
  if (state_[b].ref_count > 0 && IsPrimary(b)) ++shared_refs_;
  ++state_[b].ref_count;
}

inline void WindowBlockManager::ReleaseOne(BlockId b, bool to_front, SeqId released_by) {
  BlockState& s = state_[b];
  KVC_CHECK(s.ref_count > 0, detail::Concat("window ", window_, ": release of free block ", b));
  if (released_by >= 0) {
    if (s.releaser < 0) {
      s.releaser = released_by;
    } else {
      more_releasers_[b].push_back(released_by);
    }
  }
  if (s.ref_count > 1 && IsPrimary(b)) --shared_refs_;
  if (--s.ref_count != 0) return;
  if (IsDisk(b)) {
    DiskQueue(b);
  } else {
    Enqueue(b, to_front);
  }
}

void WindowBlockManager::Release(BlockId b, bool to_front, SeqId released_by) { ReleaseOne(b, to_front, released_by); }

void WindowBlockManager::ReleaseN(const BlockId* blocks, std::int32_t n, bool reverse, bool to_front,
                                  SeqId released_by) {
  // Runs of primary blocks that become free and hold nothing reusable join the scratch queue
  // together; any other block is released on its own, after the run before it (the same
  // queues and orders as one Release each, and a failing Release leaves the earlier ones done).
  // With lending every block goes on its own: slab order and eviction stamps follow each release.
  const bool runs = slab_blocks_ == 0 && clock_ == nullptr && released_by < 0;
  std::vector<BlockId>& scratch = release_scratch_;
  scratch.clear();
  auto flush = [&] {
    policy_.PushScratchN(CacheLevel::kPrimary, scratch.data(), static_cast<std::int32_t>(scratch.size()), to_front);
    scratch.clear();
  };
  for (std::int32_t k = 0; k < n; ++k) {
    const BlockId b = blocks[reverse ? n - 1 - k : k];
    BlockState& s = state_[b];
    if (runs && s.ref_count == 1 && s.node == kNoNode && b < num_primary_) {
      s.ref_count = 0;
      scratch.push_back(b);
    } else {
      flush();
      ReleaseOne(b, to_front, released_by);
    }
  }
  flush();
}

void WindowBlockManager::RecordRelease(BlockId b, SeqId seq) {
  BlockState& s = state_[b];
  KVC_CHECK(s.releaser >= 0, detail::Concat("window ", window_, ": block ", b, " has no release record to copy"));
  more_releasers_[b].push_back(seq);
}

void WindowBlockManager::ForgetRelease(BlockId b, SeqId seq) {
  SeqId& first = state_[b].releaser;
  std::vector<SeqId>& more = more_releasers_[b];
  if (first == seq) {  // a later releaser, if any, takes its place
    first = -1;
    if (!more.empty()) {
      first = more.back();
      more.pop_back();
    }
    return;
  }
  const auto it = std::find(more.begin(), more.end(), seq);
  KVC_CHECK(it != more.end(), detail::Concat("window ", window_, ": request ", seq, " has no release record of block ", b));
  *it = more.back();
  more.pop_back();
}

std::vector<SeqId> WindowBlockManager::Releasers(BlockId b) const {
  std::vector<SeqId> out;
  if (state_[b].releaser < 0) return out;
  out.push_back(state_[b].releaser);
  out.insert(out.end(), more_releasers_[b].begin(), more_releasers_[b].end());
  return out;
}

BlockId WindowBlockManager::Onboard(BlockId s, int priority, std::int64_t expiry_ms, std::vector<SeqId>* displaced) {
  KVC_CHECK(!IsPrimary(s) && state_[s].ref_count > 0, "onboard needs a claimed secondary block");
  // A disk slot is read before anything changes: a failed read leaves the window as it was.
  const bool read = IsDisk(s) && tier_ != nullptr && backend_->HasMemory();
  const std::vector<TierSegment> segments = read ? ReadDisk(s, &disk_buffer_) : std::vector<TierSegment>{};
  const BlockId p = Acquire(priority, expiry_ms, displaced);
  if (IsDisk(s)) {
    if (read) {
      for (std::size_t i = 0; i < pools_.size(); ++i) {
        const std::size_t bytes = segments[i].bytes;
        backend_->Copy2D(Address(p, i), CacheLevel::kPrimary, bytes, segments[i].data, CacheLevel::kSecondary, bytes,
                         bytes, 1);
      }
      backend_->Synchronize();  // before `disk_buffer_` is reused
      tier_->Erase(KeyOf(s));     // the content lives on in `p`
    }
  } else if (backend_->HasMemory()) {
    for (std::size_t i = 0; i < pools_.size(); ++i) {
      const std::size_t bytes = pools_[i].BlockBytes();
      backend_->Copy2D(Address(p, i), CacheLevel::kPrimary, bytes, Address(s, i), CacheLevel::kSecondary, bytes,
                       bytes, 1);
    }
  }
  const NodeId n = state_[s].node;
  if (n != kNoNode) {
    tree_->SetBlock(n, index_, p);
    state_[p].node = n;
    state_[p].hit = true;  // an onboard is a hit
    state_[s].node = kNoNode;
    state_[s].hit = false;
    EmitUpdated(p, std::make_pair(LevelOf(s), 0), std::nullopt);
  }
  ++onboarded_;
  Release(s);
  return p;
}

void WindowBlockManager::CopyTokens(BlockId dst, BlockId src, std::int32_t num_tokens) {
  if (!backend_->HasMemory() || num_tokens <= 0) return;
  std::vector<TierSegment> from_disk;  // a disk source is read into disk_buffer_ first
  if (IsDisk(src)) {
    if (tier_ == nullptr) return;
    from_disk = ReadDisk(src, &disk_buffer_);
  }
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    const PoolLayout& pool = pools_[p];
    const std::size_t row = static_cast<std::size_t>(pool.head_dim) * pool.elem_bytes;
    const std::size_t pitch = row * static_cast<std::size_t>(pool.tokens_per_block);
    const std::size_t rows = pool.layers.size() * static_cast<std::size_t>(pool.kv_factor * pool.num_kv_heads);
    const void* from = IsDisk(src) ? from_disk[p].data : Address(src, p);
    backend_->Copy2D(Address(dst, p), IsPrimary(dst) ? CacheLevel::kPrimary : CacheLevel::kSecondary, pitch,
                     from, IsPrimary(src) ? CacheLevel::kPrimary : CacheLevel::kSecondary, pitch,
                     row * static_cast<std::size_t>(num_tokens), rows);
  }
  if (IsDisk(src)) backend_->Synchronize();  // before `disk_buffer_` is reused
}

void WindowBlockManager::Link(BlockId b, NodeId node) {
  KVC_CHECK(state_[b].node == kNoNode && tree_->Block(node, index_) == kNullBlock, "link of a linked block or slot");
  tree_->SetBlock(node, index_, b);
  state_[b].node = node;
  if (InPolicy(b)) Requeue(b);
}

inline void WindowBlockManager::UnlinkDropped(NodeId m, BlockId x) {
  if (IsDisk(x) && tier_ != nullptr && state_[x].ref_count == 0) tier_->Erase(KeyOf(x));
  tree_->SetBlock(m, index_, kNullBlock);
  state_[x].node = kNoNode;
  state_[x].hit = false;
  if (events_ != nullptr) events_->PushRemoved(window_, tree_->Hash(m));
  if (InPolicy(x)) {
    Requeue(x);  // now holds nothing reusable: scratch
  } else if (IsDisk(x) && state_[x].ref_count == 0) {
    DiskUnqueue(x);
    DiskQueue(x);  // now holds nothing: the free list
  }
}

void WindowBlockManager::Drop(BlockId b) {
  const NodeId n = state_[b].node;
  KVC_CHECK(n != kNoNode, "drop of an uncached block");
  if (!options_.cascade_on_evict || tree_->IsLeaf(n)) {
    // Nothing below to drop (the common eviction: a leaf, or a sliding window's placeholder).
    KVC_DCHECK(tree_->Block(n, index_) == b, "cached block is not its node's block");
    UnlinkDropped(n, b);
    if (tree_->Alive(n)) tree_->PruneUp(n);
    return;
  }
  std::vector<NodeId>& nodes = drop_nodes_;  // reused: Drop never runs inside another Drop
  nodes.assign(1, n);
  if (!is_swa_) {
    // Full attention stores whole chains and drops whole subtrees, so its blocks are
    // prefix-closed (CheckInvariants verifies it): below a node without a block of this window
    // there is none, and the walk skips such subtrees (which sliding windows' blocks may keep
    // large). Breadth first: parents before children.
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      tree_->ForEachChild(nodes[i], [&](NodeId c) {
        if (tree_->Block(c, index_) != kNullBlock) nodes.push_back(c);
      });
    }
  } else {
    // A sliding window under "invalidate" stores only the positions a sequence still holds:
    // its blocks may sit below nodes without one.
    tree_->ForEachDescendant(n, [&](NodeId m) { nodes.push_back(m); });
  }
  for (const NodeId m : nodes) {
    const BlockId x = tree_->Block(m, index_);
    if (x != kNullBlock) UnlinkDropped(m, x);
  }
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    if (tree_->Alive(*it)) tree_->PruneUp(*it);
  }
}

void WindowBlockManager::SetPriority(BlockId b, int priority, std::int64_t expiry_ms) {
  const int old = state_[b].priority;
  state_[b].priority = static_cast<std::int8_t>(priority);
  if (state_[b].expiry_ms == 0 && expiry_ms != 0) timed_.push_back(b);
  state_[b].expiry_ms = expiry_ms;
  if (old == priority) return;
  if (InPolicy(b)) Requeue(b);
  EmitUpdated(b, std::nullopt, std::make_pair(old, priority));
}

void WindowBlockManager::RefreshPriorities(std::int64_t now_ms) {
  std::vector<BlockId> still;
  for (const BlockId b : timed_) {
    if (state_[b].expiry_ms == 0) continue;
    if (state_[b].expiry_ms <= now_ms) {
      state_[b].expiry_ms = 0;
      SetPriority(b, kDefaultPriority, 0);
    } else {
      still.push_back(b);
    }
  }
  timed_.swap(still);
}

void WindowBlockManager::CheckInvariants(const std::vector<std::int32_t>& expected_refs) const {
  const auto total = static_cast<BlockId>(state_.size());
  KVC_CHECK(static_cast<BlockId>(expected_refs.size()) == total, "reference table size");
  std::int64_t shared_refs = 0;
  for (BlockId b = 0; b < num_primary_; ++b) shared_refs += std::max(0, state_[b].ref_count - 1);
  KVC_CHECK(shared_refs == shared_refs_, detail::Concat("window ", window_, ": ", shared_refs_,
                                                        " shared references counted, ", shared_refs, " held"));
  std::int32_t free_primary = 0;
  std::int32_t free_secondary = 0;
  for (BlockId b = 0; b < total; ++b) {
    if (!CheckBlock(b, expected_refs[b])) continue;  // lent to another window
    if (state_[b].ref_count == 0 && !IsDisk(b)) (b < num_primary_ ? free_primary : free_secondary)++;
  }
  CheckTreeLinks();
  if (slab_blocks_ > 0) CheckSlabs();
  CheckFreeCounts(free_primary, free_secondary);
}

bool WindowBlockManager::CheckBlock(BlockId b, std::int32_t expected_refs) const {
  if (state_[b].ref_count != expected_refs) {
    throw InternalError(detail::Concat("window ", window_, ": block ", b, " has ref count ", state_[b].ref_count, " but ",
                                       expected_refs, " references from sequences and pins"));
  }
  const bool free = state_[b].ref_count == 0;
  KVC_CHECK(state_[b].releaser >= 0 || more_releasers_[b].empty(),
            detail::Concat("window ", window_, ": block ", b, " has further releasers but no first one"));
  if (IsPrimary(b) && !Owns(b)) {  // lent to another window: nothing of this window's
    KVC_CHECK(free && !policy_.Contains(b) && state_[b].node == kNoNode && state_[b].releaser < 0,
              detail::Concat("window ", window_, ": block ", b, " of a slab it does not own is in use"));
    return false;
  }
  if (IsDisk(b)) {
    CheckDiskSlot(b);
  } else if (free != policy_.Contains(b)) {
    throw InternalError(detail::Concat("window ", window_, ": block ", b,
                                       free ? " is unreferenced but not in a free queue"
                                            : " is referenced but sits in a free queue"));
  }
  if (free && !IsDisk(b)) {
    KVC_CHECK(policy_.QueuedPriority(b) == QueuePriority(b),
              detail::Concat("window ", window_, ": free block ", b, " is queued at priority ",
                             policy_.QueuedPriority(b), " instead of ", QueuePriority(b)));
    KVC_CHECK(policy_.QueuedProtected(b) == QueueProtected(b),
              detail::Concat("window ", window_, ": free block ", b, " is in the wrong ",
                             policy_.QueuedProtected(b) ? "(protected)" : "(probation)", " queue"));
  }
  if (state_[b].node != kNoNode) {
    KVC_CHECK(tree_->Alive(state_[b].node) && tree_->Block(state_[b].node, index_) == b,
              detail::Concat("window ", window_, ": block ", b, " points to a tree node that does not hold it"));
  }
  return true;
}

void WindowBlockManager::CheckTreeLinks() const {
  const auto total = static_cast<BlockId>(state_.size());
  tree_->ForEachDescendant(ReuseTree::kRoot, [&](NodeId n) {
    const BlockId b = tree_->Block(n, index_);
    if (!is_swa_ && b != kNullBlock) {
      const NodeId parent = tree_->Parent(n);
      KVC_CHECK(parent == ReuseTree::kRoot || tree_->Block(parent, index_) != kNullBlock,
                detail::Concat("window ", window_, ": tree node ", n, " holds block ", b,
                               " below a node without a block of this window (full attention's blocks must be "
                               "prefix-closed)"));
    }
    KVC_CHECK(b == kNullBlock || (b >= 0 && b < total && state_[b].node == n),
              detail::Concat("window ", window_, ": tree node ", n, " holds block ", b, " which does not point back"));
  });
}

void WindowBlockManager::CheckSlabs() const {
  std::int32_t owned = 0;
  std::int32_t wholly_free = 0;
  for (std::int32_t k = 0; k < static_cast<std::int32_t>(slab_owned_.size()); ++k) {
    std::int32_t slab_free = 0;
    for (BlockId b = k * slab_blocks_; b < (k + 1) * slab_blocks_; ++b) slab_free += policy_.Contains(b) ? 1 : 0;
    KVC_CHECK(policy_.SlabFree(k) == slab_free && policy_.SlabListed(k) == (slab_free == slab_blocks_),
              detail::Concat("window ", window_, ": slab ", k, " counts ", policy_.SlabFree(k), " free blocks, has ",
                             slab_free));
    owned += OwnsSlab(k) ? slab_blocks_ : 0;
    wholly_free += slab_free == slab_blocks_ ? 1 : 0;
  }
  KVC_CHECK(owned == owned_primary_ && wholly_free == policy_.NumFreeSlabs(),
            detail::Concat("window ", window_, ": owns ", owned, " blocks (counted ", owned_primary_, "), ",
                           wholly_free, " wholly free slabs (counted ", policy_.NumFreeSlabs(), ")"));
}

void WindowBlockManager::CheckFreeCounts(std::int32_t free_primary, std::int32_t free_secondary) const {
  const auto total = static_cast<BlockId>(state_.size());
  std::int32_t visited = 0;
  policy_.ForEach(CacheLevel::kPrimary, [&](BlockId b) {
    KVC_CHECK(b >= 0 && b < num_primary_, "secondary block in the primary free queue");
    ++visited;
  });
  KVC_CHECK(visited == free_primary && policy_.NumFree(CacheLevel::kPrimary) == free_primary,
            detail::Concat("window ", window_, ": primary free count ", policy_.NumFree(CacheLevel::kPrimary), " but ",
                           free_primary, " free blocks (", visited, " queued)"));
  visited = 0;
  policy_.ForEach(CacheLevel::kSecondary, [&](BlockId b) {
    KVC_CHECK(b >= num_primary_ && b < total, "primary block in the secondary free queue");
    ++visited;
  });
  KVC_CHECK(visited == free_secondary && policy_.NumFree(CacheLevel::kSecondary) == free_secondary,
            detail::Concat("window ", window_, ": secondary free count mismatch"));
}

}  // namespace kvcache
