// The manager's configuration and reports: the model's shape, the manager's options, stats and
// the views an engine reads (the types of kv_cache_manager.h's interface).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvcache/block_key.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/sequence.h"
#include "kvcache/state_pool.h"
#include "kvcache/types.h"

namespace kvcache {

/// Shape of the model's KV cache.
struct ModelSpec {
  std::int32_t num_layers = 0;
  /// KV heads per layer (num_layers entries), or a single entry used for every layer.
  std::vector<std::int32_t> num_kv_heads;
  /// Head size of every layer, unless `head_dims` gives one per layer.
  std::int32_t head_dim = 0;
  /// KV element type of every layer, unless `dtypes` gives one per layer.
  DType dtype = DType::kFloat16;
  std::int32_t kv_factor = 2;  ///< 2 = K and V; 1 = K only (MLA).
  /// Head size per layer (num_layers entries); empty: `head_dim` for every layer.
  std::vector<std::int32_t> head_dims;
  /// KV element type per layer (num_layers entries); empty: `dtype` for every layer.
  std::vector<DType> dtypes;
  /// Recurrent layers (Mamba, Gated DeltaNet, short convolution), each with its state tensors;
  /// layers with identical tensors form one state group with a pool of its own. Empty: none.
  /// `num_layers` counts the attention layers only.
  std::vector<std::vector<StateTensorSpec>> recurrent_layers;
};

/// Block counts of one window.
struct WindowBlocks {
  std::int32_t primary = 0;
  std::int32_t secondary = 0;
};

/// What happens to a running sequence's released out-of-window blocks when another sequence
/// reclaims them.
enum class SwaReusePolicy : std::uint8_t {
  /// The releasing sequence becomes invalid for store-for-reuse and stores nothing at the end;
  /// evicting a sliding-window block drops the tree below it in that window.
  kInvalidate,
  /// The chain keeps its identity: a reclaimed position becomes a placeholder for that window
  /// and everything else is stored; a sliding window only needs its last `window` tokens.
  kPlaceholder,
};

/// Everything the manager needs besides the model.
struct ManagerConfig {
  std::int32_t tokens_per_block = 32;
  /// Window per layer, repeating over the layers; <= 0 or >= max_seq_len means full attention.
  /// Empty: every layer is full attention.
  std::vector<std::int32_t> max_attention_window;
  std::int32_t max_seq_len = 0;     ///< Required: longest sequence (prompt + generated tokens).
  std::int32_t max_batch_size = 0;  ///< Most sequences registered at once (0: no limit).
  std::map<WindowSize, WindowBlocks> blocks_per_window;  ///< Keys must equal the window sizes.
  BackendKind backend = BackendKind::kAuto;
  /// Sliding windows keep this many tokens beyond the window, so rewinding up to this many
  /// tokens (rejected draft tokens) never needs a block that was already released.
  std::int32_t max_draft_tokens = 0;
  bool enable_block_reuse = false;
  bool enable_partial_reuse = true;
  bool copy_on_partial_reuse = true;
  bool onboard_blocks = true;
  int secondary_offload_min_priority = 30;
  std::size_t event_buffer_max_size = 0;  ///< 0: no events.
  SwaReusePolicy swa_reuse_policy = SwaReusePolicy::kPlaceholder;
  /// Segmented LRU: a cached block that served a reuse hit is evicted only after the blocks of
  /// its priority that never did (false: plain LRU per priority).
  bool protect_hit_blocks = true;
  /// Most blocks of a window (share per cache level, in [0, 1]) that wait as protected.
  double protected_fraction = EvictionPolicy::kDefaultProtectedFraction;
  /// Windows lend each other memory: every window's primary blocks live in one shared arena cut
  /// into slabs (the least common multiple of the windows' block sizes); a window that runs out
  /// of free blocks takes a wholly free slab of another window (evicting what it cached) instead
  /// of failing. `blocks_per_window` is then the initial split. Block ids span the whole arena.
  bool lend_free_memory = false;
  /// Disk-tier slots per window (below the secondary pool; missing windows: none).
  std::map<WindowSize, std::int32_t> disk_blocks_per_window;
  std::string disk_cache_dir;  ///< Directory of the disk tier; empty: a private temporary one.
  /// The shared tier: a Redis server, `redis://host[:port][/db]` (empty: none). Needs block
  /// reuse and a backend with memory.
  std::string shared_cache_url;
  /// Key prefix in the store; empty: `kvcache:<fingerprint>` of what makes KV interchangeable.
  std::string shared_cache_namespace;
  std::int32_t shared_cache_timeout_ms = 5;  ///< Bound on one add_sequence's store lookups.
  std::size_t shared_cache_queue_bytes = std::size_t{64} << 20;  ///< Write queue bound (bytes).
  /// Slots of each state group (recurrent layers): one working slot per registered sequence
  /// (max_batch_size of them are always kept available) plus checkpoints. Required with
  /// recurrent layers, > max_batch_size.
  std::int32_t state_slots = 0;
  /// Host slots of each state group: an evicted checkpoint is moved there (0: dropped).
  std::int32_t state_secondary_slots = 0;
  CheckpointPolicy checkpoint_policy;
};

/// Counters and occupancy. Block counts are primary blocks summed over windows.
struct KvCacheStats {
  std::int64_t max_num_blocks = 0;
  std::int64_t free_num_blocks = 0;
  std::int64_t used_num_blocks = 0;
  std::int32_t tokens_per_block = 0;
  std::int64_t alloc_total_blocks = 0;  ///< Blocks given to sequences (new + reused).
  std::int64_t alloc_new_blocks = 0;    ///< Blocks taken from the free queues.
  std::int64_t reused_blocks = 0;
  std::int64_t missed_blocks = 0;
  double cache_hit_rate = 0.0;  ///< reused / (reused + missed), 0 when both are 0.
  std::map<WindowSize, std::int64_t> num_free_blocks_per_window_size;
  std::int64_t allocated_bytes = 0;  ///< Pool bytes actually allocated (0 for virtual).
  std::int64_t offloaded_blocks = 0;
  std::int64_t onboarded_blocks = 0;
  /// Disk-tier blocks dropped because they could not be read back intact (each a miss).
  std::int64_t disk_read_failures = 0;
  /// Shared tier: blocks onboarded from the store, blocks the store accepted, blocks not written
  /// (the write queue was full) and failures (lookups or writes that failed or timed out, values
  /// refused: not verifying under their key, empty, or of another Redis type); connections the
  /// store refused to authenticate.
  std::int64_t shared_hits = 0;
  std::int64_t shared_writes = 0;
  std::int64_t shared_write_drops = 0;
  std::int64_t shared_errors = 0;
  std::int64_t shared_auth_failures = 0;
  std::map<WindowSize, std::int64_t> reused_blocks_per_window_size;
  std::map<WindowSize, std::int64_t> missed_blocks_per_window_size;
  std::int64_t num_cached_nodes = 0;  ///< Nodes of the reuse tree (root excluded).
  /// Slabs that windows lent each other (lend_free_memory), and the primary blocks each window
  /// owns now (its initial blocks without lending).
  std::int64_t lent_slabs = 0;
  std::map<WindowSize, std::int64_t> num_owned_blocks_per_window_size;
  /// Forks (ForkSequence): block references that children took from their parents (summed over
  /// windows; no block is taken), and private copies that a write into a shared block made
  /// (copy-on-write, by AddTokens, Prefill and Rewind).
  std::int64_t forked_blocks = 0;
  std::int64_t copied_on_write_blocks = 0;
  /// Recurrent state (summed over state groups): slots, and how many are working states,
  /// checkpoints being written, cached checkpoints and free.
  std::int64_t state_slots = 0;
  std::int64_t working_state_slots = 0;
  std::int64_t pending_checkpoints = 0;
  std::int64_t cached_checkpoints = 0;
  std::int64_t free_state_slots = 0;
  /// Checkpoints stored in the reuse tree, hits resumed from one, checkpoints not taken (no
  /// slot to spare, a prefill chunk straddled the position, or the chain was not stored) and
  /// checkpoints evicted.
  std::int64_t checkpoints_stored = 0;
  std::int64_t checkpoints_restored = 0;
  std::int64_t checkpoints_skipped = 0;
  std::int64_t checkpoints_evicted = 0;
  /// Checkpoints moved to host slots by an eviction, hits restored from a host slot, and the
  /// checkpoints cached on the host now.
  std::int64_t checkpoints_offloaded = 0;
  std::int64_t checkpoints_onboarded = 0;
  std::int64_t host_cached_checkpoints = 0;
  /// Why prompt tokens that the tree's keys matched were not reused (add_sequence, summed over
  /// admissions): full-attention blocks evicted, a sliding window's blocks evicted, no state
  /// checkpoint at the position (or none that could be held for the restore).
  std::int64_t lost_hit_tokens_attention = 0;
  std::int64_t lost_hit_tokens_sliding_window = 0;
  std::int64_t lost_hit_tokens_no_checkpoint = 0;
};

/// One state group as an engine sees it: its layers, tensors and where its slots are.
struct StateGroupInfo {
  std::vector<std::int32_t> layers;  ///< Recurrent-layer indices.
  std::vector<StateTensorSpec> tensors;
  std::size_t slot_bytes = 0;
  std::int32_t num_slots = 0;
  std::int32_t num_secondary = 0;  ///< Host slots (ids after the primary ones).
  std::uintptr_t ptr = 0;
};

/// Strided view of one state tensor of one recurrent layer over every slot:
/// `[num_slots, *shape]`, strides in bytes.
struct StateView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  BackendKind backend = BackendKind::kHost;
};

/// How far each kind of group could resume a prompt (tokens), from one lookup.
struct ReusableByKind {
  std::int32_t matched = 0;          ///< Prompt tokens whose keys the reuse tree holds.
  std::int32_t full_attention = 0;   ///< ... with every full-attention block cached.
  std::int32_t sliding_window = 0;   ///< ... and every sliding window's last window.
  std::int32_t recurrent_state = 0;  ///< ... and a checkpoint of every state group there.
  std::int32_t reused = 0;           ///< What add_sequence would reuse (partial block included).
};

/// Per-request reuse counters (summed over windows).
struct RequestStats {
  std::int32_t reused_tokens = 0;  ///< Prompt tokens found in every window at add_sequence.
  std::int64_t reused_blocks = 0;
  std::int64_t missed_blocks = 0;
  std::int64_t new_blocks = 0;
};

/// One pool as seen by an engine: which layers it holds, their shape and where its memory is.
/// A pool holds the layers of one window that share (KV-head count, head size, dtype).
struct PoolInfo {
  WindowSize window = 0;
  std::int32_t num_kv_heads = 0;
  std::vector<std::int32_t> layers;
  std::int32_t kv_factor = 2;
  std::int32_t head_dim = 0;
  DType dtype = DType::kFloat16;
  std::size_t block_bytes = 0;  ///< One block of this pool: every layer, K and V.
  /// Bytes from one primary block to the next: block_bytes, or more when windows share memory
  /// (the blocks of a window's pools interleave in the shared arena).
  std::size_t block_stride = 0;
  std::int32_t num_primary = 0;
  std::int32_t num_secondary = 0;
  std::uintptr_t primary_ptr = 0;
  std::uintptr_t secondary_ptr = 0;
};

/// Strided view of one layer's primary K/V memory:
/// `[primary_blocks, kv_factor, num_kv_heads, tokens_per_block, head_dim]`.
struct LayerView {
  void* data = nullptr;
  DType dtype = DType::kFloat16;
  std::array<std::int64_t, 5> shape{};
  std::array<std::int64_t, 5> strides{};  ///< In bytes.
  BackendKind backend = BackendKind::kHost;
};

/// Options of AddSequence.
struct SequenceOptions {
  std::optional<int> priority;  ///< Retention priority 0..100 of this sequence's blocks.
  /// Priorities of prompt token ranges; a block takes the range holding its first token.
  std::vector<PriorityRange> priority_ranges;
  std::optional<int> decode_priority;     ///< Priority of blocks of generated tokens.
  std::int64_t decode_duration_ms = 0;    ///< 0: the decode priority does not expire.
  ReuseExtras extras;                     ///< LoRA id, cache salt, multimodal items.
};

}  // namespace kvcache
