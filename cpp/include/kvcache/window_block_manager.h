// The blocks of one attention window: pool memory, block metadata and free queues.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcache/eviction_policy.h"
#include "kvcache/memory_backend.h"
#include "kvcache/types.h"

namespace kvcache {

/// Shape of one pool: the layers of one window that share a KV-head count. Its memory is
/// `[blocks, layers.size(), kv_factor, num_kv_heads, tokens_per_block, head_dim]`, so one block
/// holds every layer of the pool.
struct PoolLayout {
  std::int32_t num_kv_heads = 0;
  std::vector<std::int32_t> layers;  ///< Global layer indices, ascending.
  std::int32_t kv_factor = 2;
  std::int32_t tokens_per_block = 0;
  std::int32_t head_dim = 0;
  std::int32_t elem_bytes = 0;

  /// Bytes of one K (or V) slab of one layer of one block: `[heads, tokens, head_dim]`.
  std::size_t SlabBytes() const {
    return static_cast<std::size_t>(num_kv_heads) * tokens_per_block * head_dim * elem_bytes;
  }
  /// Bytes of one block of this pool (all its layers, K and V).
  std::size_t BlockBytes() const { return layers.size() * kv_factor * SlabBytes(); }
};

/// Owns the pools of one window and the state of each block: reference count, last owner and
/// membership in the free queues. Block ids are slots: primary ids [0, num_primary), secondary
/// ids after them. Not thread-safe; the manager serializes access.
class WindowBlockManager {
 public:
  WindowBlockManager(WindowSize window, bool is_swa, std::vector<PoolLayout> pools,
                     std::int32_t num_primary, std::int32_t num_secondary, MemoryBackend* backend);
  ~WindowBlockManager();
  WindowBlockManager(const WindowBlockManager&) = delete;
  WindowBlockManager& operator=(const WindowBlockManager&) = delete;

  WindowSize window() const { return window_; }
  bool is_swa() const { return is_swa_; }
  std::int32_t num_primary() const { return num_primary_; }
  std::int32_t num_secondary() const { return num_secondary_; }
  const std::vector<PoolLayout>& pools() const { return pools_; }
  void* primary_base(std::size_t pool) const { return primary_[pool]; }
  void* secondary_base(std::size_t pool) const { return secondary_[pool]; }
  /// Bytes actually allocated for this window's pools (0 on the virtual backend).
  std::size_t allocated_bytes() const { return allocated_bytes_; }

  /// Primary blocks that can be handed out now.
  std::int32_t NumFreePrimary() const { return policy_.NumFree(CacheLevel::kPrimary); }
  /// Hands out the next free primary block to `owner` with one reference.
  /// Precondition (checked): NumFreePrimary() > 0.
  BlockId Acquire(SeqId owner);
  /// Adds a reference to an already referenced block.
  void AddRef(BlockId b);
  /// Drops one reference; at zero the block is queued free (at the front if `to_front`).
  void Release(BlockId b, bool to_front = false);
  std::int32_t RefCount(BlockId b) const { return ref_count_[b]; }
  /// The sequence that acquired `b` last (or -1 if never handed out).
  SeqId Owner(BlockId b) const { return owner_[b]; }
  const EvictionPolicy& policy() const { return policy_; }

  /// Verifies that reference counts equal `expected_refs` (per block id, counted from the
  /// sequences' block lists) and that the free queues hold exactly the unreferenced blocks.
  /// Throws InternalError naming the first violation.
  void CheckInvariants(const std::vector<std::int32_t>& expected_refs) const;

 private:
  WindowSize window_;
  bool is_swa_;
  std::vector<PoolLayout> pools_;
  std::int32_t num_primary_;
  std::int32_t num_secondary_;
  MemoryBackend* backend_;
  std::vector<void*> primary_;
  std::vector<void*> secondary_;
  std::size_t allocated_bytes_ = 0;
  std::vector<std::int32_t> ref_count_;
  std::vector<SeqId> owner_;
  EvictionPolicy policy_;
};

}  // namespace kvcache
