// Slab lending between windows (ManagerConfig::lend_free_memory): the shared arena, the plan of
// the slabs a call borrows, the moves, and the rebalancing between steps. The manager asks its
// lender; without lending the lender's answers are the windows' own (nothing is shared).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/memory_backend.h"
#include "kvcache/reuse_tree.h"
#include "kvcache/types.h"
#include "kvcache/window_block_manager.h"

namespace kvcache {

struct ManagerConfig;

/// Blocks a call claims or reads (AddSequence's reused prefix and the source of a partly reused
/// block): no slab holding one is lent while the call runs. In window w: the blocks of tree
/// nodes path[front[w]], ..., path[end - 1], and partial[w] unless `partial` is null.
struct KeptBlocks {
  const ReuseTree* tree = nullptr;
  const NodeId* path = nullptr;
  std::int32_t end = 0;
  const std::int32_t* front = nullptr;  ///< per window
  const BlockId* partial = nullptr;     ///< per window, or null
};

/// Where window w's primary blocks live: `num_primary` block ids, in `shared` (a part of the
/// arena that every window shares) or, when `shared` is null, in pools of its own.
struct WindowPrimary {
  std::int32_t num_primary = 0;
  const SharedPrimary* shared = nullptr;
};

/// The windows' primary memory as one budget. Made by Make: with lending, one arena cut into
/// slabs that windows lend each other (a window short of free blocks borrows wholly free slabs
/// of the others; between steps slabs move towards the window that evicted cache); without it,
/// every answer is the windows' own (each window has its pools, nothing moves).
///
/// A mutating call plans with PlanBlocks, then (having claimed what it reuses) carries the plan
/// out with MoveSlabs before it changes anything else. Sequences that had released a lent block
/// out of window lose that content: MoveSlabs and Rebalance report them, and the manager
/// invalidates them. Not thread-safe; the manager serializes access.
class SlabLender {
 public:
  using Windows = std::vector<std::unique_ptr<WindowBlockManager>>;

  /// Lends when `config.lend_free_memory` and there are several windows: plans the arena from
  /// the windows' pools and initial block counts and allocates it from `backend` (throws
  /// std::invalid_argument for a geometry that cannot be shared). `windows` is the manager's
  /// list, filled after this call (see Start); it must outlive the lender's use of it, and the
  /// lender (its arena) must outlive the windows.
  static std::unique_ptr<SlabLender> Make(const ManagerConfig& config, const std::vector<WindowSize>& window_sizes,
                                          const std::vector<std::vector<PoolLayout>>& window_pools,
                                          MemoryBackend* backend, const Windows& windows);
  virtual ~SlabLender();
  SlabLender(const SlabLender&) = delete;
  SlabLender& operator=(const SlabLender&) = delete;

  /// Whether windows lend each other memory.
  virtual bool lends() const = 0;
  /// Where window w's primary blocks live (`own_primary`: its configured primary blocks).
  virtual WindowPrimary Primary(std::size_t w, std::int32_t own_primary) const = 0;
  /// Once the windows exist: under lending they stamp their free blocks from one eviction clock,
  /// so that Rebalance can compare victims across windows.
  virtual void Start() = 0;

  /// The blocks check of a mutating call: window w must hand out need[w] blocks and has
  /// available[w] (free now plus what the call releases before it allocates). Returns the first
  /// window short of blocks, or -1. Under lending a short window may borrow wholly free slabs of
  /// the others: a donor lends only slabs wholly free now that hold none of `kept` (may be null),
  /// and keeps enough for its own need. On success the plan is kept for MoveSlabs.
  virtual std::int64_t PlanBlocks(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available,
                                  const KeptBlocks* kept = nullptr) = 0;
  /// Moves the slabs PlanBlocks planned (none if it failed or was not called), each from the
  /// donor that can lend the most. Returns the live sequences that had released a lent block
  /// out of window (valid until the next call).
  virtual const std::vector<SeqId>& MoveSlabs() = 0;
  /// Between steps (RefreshBlocks): under lending, a window that evicted cached blocks since the
  /// last call takes, up to that many blocks, wholly free slabs of other windows whose next
  /// victims are cheaper to lose than its own. Returns the sequences as MoveSlabs does.
  virtual const std::vector<SeqId>& Rebalance() = 0;

  /// Whether the windows can hand out need[w] blocks each over a whole step (several calls) with
  /// available[w] blocks: under lending they compete for the same lendable slabs, and a donor
  /// with several blocks per slab is assumed to take its own blocks first.
  virtual bool ServesStep(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available) const = 0;
  /// Whether an empty manager could hold need[window] blocks of every window at once (`index`
  /// maps a window size to its index, throwing for an unknown one).
  virtual bool FitsWhenEmpty(const std::map<WindowSize, std::int32_t>& need,
                             const std::function<std::size_t(WindowSize)>& index) const = 0;
  /// Blocks window w can hand out now: its free blocks, plus under lending those the other
  /// windows' wholly free slabs would give it if it alone asked.
  virtual std::int32_t FreeBlocks(std::size_t w) const = 0;
  /// What an out-of-blocks message adds for window w: under lending, how many of FreeBlocks
  /// the other windows would lend; else "".
  virtual std::string LendNote(std::size_t w) const = 0;

  /// Slabs moved between windows so far.
  virtual std::int64_t lent_slabs() const = 0;
  /// Bytes of the shared arena (0 without lending).
  virtual std::size_t arena_bytes() const = 0;
  /// The windows' slabs partition the arena, and no planned move outlived its call. Throws
  /// InternalError.
  virtual void CheckInvariants() const = 0;

 protected:
  SlabLender() = default;
};

}  // namespace kvcache
