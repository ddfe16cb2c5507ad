// SlabLender: windows without lending (each its own pools), and windows lending each other
// wholly free slabs of one shared arena (ManagerConfig::lend_free_memory).
#include "kvcache/slab_lender.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "kvcache/block_math.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {
namespace {

using block_math::CeilDiv;

std::size_t RoundUp(std::size_t x, std::size_t unit) { return (x + unit - 1) / unit * unit; }

/// Least common multiple, or 0 past `limit`.
std::size_t LcmUpTo(std::size_t a, std::size_t b, std::size_t limit) {
  const std::size_t g = std::gcd(a, b);
  const std::size_t q = a / g;
  if (q > limit / b) return 0;
  return q * b;
}

/// Most blocks of one window in a slab: beyond it, lending moves too much memory at once.
constexpr std::size_t kMaxBlocksPerSlab = 1024;

[[noreturn]] void ThrowNoCommonSlab() {
  ThrowInvalid("lend_free_memory: the windows' block sizes have no common multiple of at most ", kMaxBlocksPerSlab,
               " blocks of any window, so they cannot lend each other memory");
}

/// Each window's block interleaves its pools (each pool's part aligned to that pool's K/V slab,
/// the block stride a multiple of every such slab, so block offsets stay whole slabs); fills
/// pool_offsets and block_stride of out[w], and returns the arena's slab: the least common
/// multiple of the windows' strides.
std::size_t PlanBlockStrides(const std::vector<std::vector<PoolLayout>>& window_pools,
                             const std::vector<WindowSize>& windows, std::vector<SharedPrimary>* out) {
  std::size_t slab = 1;
  for (std::size_t w = 0; w < windows.size(); ++w) {
    SharedPrimary& sp = (*out)[w];
    std::size_t offset = 0;
    std::size_t unit = 1;
    for (const PoolLayout& pool : window_pools[w]) {
      const std::size_t kv_slab = pool.SlabBytes();
      offset = RoundUp(offset, kv_slab);
      sp.pool_offsets.push_back(offset);
      offset += pool.BlockBytes();
      unit = LcmUpTo(unit, kv_slab, std::numeric_limits<std::size_t>::max() / 2);
      if (unit == 0) ThrowInvalid("lend_free_memory: the pools of window ", windows[w], " have no common block size");
    }
    sp.block_stride = RoundUp(offset, unit);
    slab = LcmUpTo(slab, sp.block_stride, sp.block_stride * kMaxBlocksPerSlab);
    if (slab == 0) ThrowNoCommonSlab();
  }
  for (const SharedPrimary& sp : *out) {
    if (slab / sp.block_stride > kMaxBlocksPerSlab) ThrowNoCommonSlab();
  }
  return slab;
}

/// The slabs each window owns at first: the arena's `num_slabs` apportioned by the windows'
/// configured bytes (largest remainder), then at least one slab each (taken from the largest).
std::vector<std::int64_t> ApportionSlabs(const std::vector<SharedPrimary>& sp, const std::vector<WindowSize>& windows,
                                         const std::map<WindowSize, WindowBlocks>& blocks, std::size_t slab,
                                         std::size_t num_slabs) {
  const std::size_t n = windows.size();
  std::vector<std::int64_t> owned(n);
  std::vector<std::pair<double, std::size_t>> rest;
  std::int64_t given = 0;
  for (std::size_t w = 0; w < n; ++w) {
    const double exact = static_cast<double>(sp[w].block_stride) * blocks.at(windows[w]).primary / static_cast<double>(slab);
    owned[w] = static_cast<std::int64_t>(exact);
    given += owned[w];
    rest.emplace_back(-(exact - static_cast<double>(owned[w])), w);
  }
  std::sort(rest.begin(), rest.end());
  for (std::size_t i = 0; given < static_cast<std::int64_t>(num_slabs); ++i, ++given) ++owned[rest[i % n].second];
  for (std::size_t w = 0; w < n; ++w) {
    while (owned[w] < 1) {
      const auto big = static_cast<std::size_t>(std::max_element(owned.begin(), owned.end()) - owned.begin());
      --owned[big];
      ++owned[w];
    }
  }
  return owned;
}

/// Geometry of the arena shared by every window under lend_free_memory: the block strides and
/// the slab (PlanBlockStrides); the arena is as many slabs as the windows' blocks fill,
/// apportioned to the windows (ApportionSlabs).
std::vector<SharedPrimary> PlanSharedPrimary(const std::vector<std::vector<PoolLayout>>& window_pools,
                                             const std::vector<WindowSize>& windows,
                                             const std::map<WindowSize, WindowBlocks>& blocks,
                                             const std::map<WindowSize, std::int32_t>& disk_blocks,
                                             std::size_t* arena_bytes) {
  const std::size_t n = windows.size();
  std::vector<SharedPrimary> out(n);
  const std::size_t slab = PlanBlockStrides(window_pools, windows, &out);
  std::size_t budget = 0;
  for (std::size_t w = 0; w < n; ++w) {
    budget += out[w].block_stride * static_cast<std::size_t>(blocks.at(windows[w]).primary);
  }
  const std::size_t num_slabs = budget / slab;
  if (num_slabs < n) {
    ThrowInvalid("lend_free_memory: the primary blocks make ", num_slabs, " slab(s) of ", slab,
                 " bytes, fewer than one per window (", n, ")");
  }
  const std::vector<std::int64_t> owned = ApportionSlabs(out, windows, blocks, slab, num_slabs);
  std::int64_t first = 0;
  for (std::size_t w = 0; w < n; ++w) {
    SharedPrimary& sp = out[w];
    sp.blocks_per_slab = static_cast<std::int32_t>(slab / sp.block_stride);
    sp.num_slabs = static_cast<std::int32_t>(num_slabs);
    sp.first_slab = static_cast<std::int32_t>(first);
    sp.owned_slabs = static_cast<std::int32_t>(owned[w]);
    first += owned[w];
    const auto disk = disk_blocks.find(windows[w]);
    const std::int64_t ids = static_cast<std::int64_t>(num_slabs) * sp.blocks_per_slab +
                             blocks.at(windows[w]).secondary + (disk == disk_blocks.end() ? 0 : disk->second);
    if (ids > std::numeric_limits<std::int32_t>::max()) {
      ThrowInvalid("lend_free_memory: window ", windows[w], " would span ", ids, " block ids, more than 2**31 - 1");
    }
  }
  *arena_bytes = num_slabs * slab;
  return out;
}

/// The first window with fewer available blocks than it needs, or -1.
std::int64_t FirstShort(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available) {
  for (std::size_t w = 0; w < need.size(); ++w) {
    if (available[w] < need[w]) return static_cast<std::int64_t>(w);
  }
  return -1;
}

/// Every window has its own pools: plans check each window's own blocks, nothing moves.
class NoLending final : public SlabLender {
 public:
  explicit NoLending(const Windows& windows) : windows_(windows) {}

  bool lends() const override { return false; }
  WindowPrimary Primary(std::size_t /*w*/, std::int32_t own_primary) const override { return {own_primary, nullptr}; }
  void Start() override {}
  std::int64_t PlanBlocks(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available,
                          const KeptBlocks* /*kept*/) override {
    return FirstShort(need, available);
  }
  const std::vector<SeqId>& MoveSlabs() override { return none_; }
  const std::vector<SeqId>& Rebalance() override { return none_; }
  bool ServesStep(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available) const override {
    return FirstShort(need, available) < 0;
  }
  bool FitsWhenEmpty(const std::map<WindowSize, std::int32_t>& need,
                     const std::function<std::size_t(WindowSize)>& index) const override {
    for (const auto& [window, n] : need) {
      const WindowBlockManager& wm = *windows_[index(window)];
      if (n > 0 && n > wm.NumOwnedPrimary()) return false;
    }
    return true;
  }
  std::int32_t FreeBlocks(std::size_t w) const override { return windows_[w]->NumFreePrimary(); }
  std::string LendNote(std::size_t /*w*/) const override { return ""; }
  std::int64_t lent_slabs() const override { return 0; }
  std::size_t arena_bytes() const override { return 0; }
  void CheckInvariants() const override {}

 private:
  const Windows& windows_;
  const std::vector<SeqId> none_;
};

/// Every window's primary blocks live in one arena cut into slabs (the same bytes for every
/// window); a window owns whole slabs and lends wholly free ones.
class SharedArenaLender final : public SlabLender {
 public:
  SharedArenaLender(const ManagerConfig& config, const std::vector<WindowSize>& window_sizes,
                    const std::vector<std::vector<PoolLayout>>& window_pools, MemoryBackend* backend,
                    const Windows& windows);

  bool lends() const override { return true; }
  WindowPrimary Primary(std::size_t w, std::int32_t /*own_primary*/) const override {
    const SharedPrimary& sp = shared_[w];
    return {sp.num_slabs * sp.blocks_per_slab, &sp};
  }
  void Start() override {  // Rebalance compares victims across windows by these keys
    for (const auto& wm : windows_) wm->EnableEvictionKeys(&evict_clock_);
  }
  std::int64_t PlanBlocks(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available,
                          const KeptBlocks* kept) override;
  const std::vector<SeqId>& MoveSlabs() override;
  const std::vector<SeqId>& Rebalance() override;
  bool ServesStep(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available) const override {
    return FirstUnserved(need, available, nullptr, /*over_calls=*/true, nullptr, nullptr) < 0;
  }
  bool FitsWhenEmpty(const std::map<WindowSize, std::int32_t>& need,
                     const std::function<std::size_t(WindowSize)>& index) const override;
  std::int32_t FreeBlocks(std::size_t w) const override;
  std::string LendNote(std::size_t w) const override {
    const std::int32_t blocks = FreeBlocks(w) - windows_[w]->NumFreePrimary();
    return detail::Concat(" (counting ", blocks, " that the other windows' wholly free slabs could lend it alone)");
  }
  std::int64_t lent_slabs() const override { return lent_slabs_; }
  std::size_t arena_bytes() const override { return arena_.bytes; }
  void CheckInvariants() const override;

 private:
  /// The check behind PlanBlocks and ServesStep: the first window that neither its own blocks
  /// nor what the others can lend serve, or -1. Fills *borrow (slabs per short window) and
  /// *lendable (slabs per donor) when given.
  std::int64_t FirstUnserved(const std::vector<std::int64_t>& need, const std::vector<std::int64_t>& available,
                             const std::vector<std::vector<BlockId>>* keep, bool over_calls,
                             std::vector<std::int64_t>* borrow, std::vector<std::int64_t>* lendable) const;
  /// What window v could lend now while keeping `need_v` of its `available_v` blocks, in slabs;
  /// `over_calls`: the blocks are taken by several calls (ServesStep for a whole step), so the
  /// donor's own blocks may be taken before the slabs move.
  std::int64_t Lendable(std::size_t v, std::int64_t need_v, std::int64_t available_v,
                        const std::vector<BlockId>* keep, bool over_calls) const;
  /// keep_[w]: the blocks of `kept` in window w.
  void CollectKept(const KeptBlocks& kept);
  /// The one door of a slab between windows: `donor` lends `slab` (its releasers are collected
  /// in displaced_) and window w adopts it.
  void MoveSlab(std::size_t donor, std::size_t w, std::int32_t slab);

  struct Arena {  // the primary memory shared by every window
    MemoryBackend* backend = nullptr;
    void* ptr = nullptr;
    std::size_t bytes = 0;
    Arena() = default;
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;
    ~Arena() {
      if (backend != nullptr) backend->Free(CacheLevel::kPrimary, ptr);
    }
  };
  Arena arena_;
  std::vector<SharedPrimary> shared_;  // per window: its view of the arena
  const Windows& windows_;
  /// Between steps only windows under "placeholder" move slabs (see Rebalance).
  bool rebalance_ = true;
  std::vector<std::int64_t> borrow_;    // per window: slabs to borrow (PlanBlocks -> MoveSlabs)
  std::vector<std::int64_t> lendable_;  // per window: slabs it may lend in that move
  std::vector<std::vector<BlockId>> keep_;  // per window: blocks of the planned call's KeptBlocks
  bool keep_planned_ = false;               // the plan keeps keep_'s slabs
  std::uint64_t evict_clock_ = 0;  // eviction stamps shared by the windows
  std::vector<SeqId> displaced_;   // releasers of blocks being lent
  std::int64_t lent_slabs_ = 0;
};

SharedArenaLender::SharedArenaLender(const ManagerConfig& config, const std::vector<WindowSize>& window_sizes,
                                     const std::vector<std::vector<PoolLayout>>& window_pools, MemoryBackend* backend,
                                     const Windows& windows)
    : windows_(windows) {
  shared_ = PlanSharedPrimary(window_pools, window_sizes, config.blocks_per_window, config.disk_blocks_per_window,
                              &arena_.bytes);
  arena_.ptr = backend->Allocate(CacheLevel::kPrimary, arena_.bytes);
  arena_.backend = backend;
  for (SharedPrimary& sp : shared_) sp.base = static_cast<unsigned char*>(arena_.ptr);
  // Under "invalidate" a sliding window's eviction drops the chain below the block and a
  // reclaimed out-of-window block stops its releaser from storing anything, costs the keys do
  // not see: moving eviction pressure between windows measured worse there (bench/README.md).
  rebalance_ = config.swa_reuse_policy != SwaReusePolicy::kInvalidate;
  borrow_.assign(window_sizes.size(), 0);
  lendable_.assign(window_sizes.size(), 0);
  keep_.resize(window_sizes.size());
}

std::int64_t SharedArenaLender::Lendable(std::size_t v, std::int64_t need_v, std::int64_t available_v,
                                         const std::vector<BlockId>* keep, bool over_calls) const {
  const WindowBlockManager& wm = *windows_[v];
  const std::int32_t m = wm.blocks_per_slab();
  std::int64_t slabs = wm.NumFreeSlabs();
  // Over several calls the donor's own blocks may be taken before a slab is lent, each
  // breaking at most one wholly free slab (with one block per slab it takes the slab anyway).
  if (over_calls && m > 1) slabs -= need_v;
  if (keep != nullptr) {  // wholly free slabs holding a kept block are not lent
    std::vector<std::int32_t> kept;
    for (const BlockId b : *keep) {
      if (b == kNullBlock || !wm.IsPrimary(b) || !wm.policy().SlabListed(b / m)) continue;
      if (std::find(kept.begin(), kept.end(), b / m) == kept.end()) kept.push_back(b / m);
    }
    slabs -= static_cast<std::int64_t>(kept.size());
  }
  return std::max<std::int64_t>(0, std::min(slabs, (available_v - need_v) / m));
}

std::int64_t SharedArenaLender::FirstUnserved(const std::vector<std::int64_t>& need,
                                              const std::vector<std::int64_t>& available,
                                              const std::vector<std::vector<BlockId>>* keep, bool over_calls,
                                              std::vector<std::int64_t>* borrow,
                                              std::vector<std::int64_t>* lendable) const {
  std::int64_t first_short = -1;
  std::int64_t short_slabs = 0;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const bool short_w = available[w] < need[w];
    if (short_w && first_short < 0) first_short = static_cast<std::int64_t>(w);
    const std::int64_t slabs = short_w ? CeilDiv(need[w] - available[w], windows_[w]->blocks_per_slab()) : 0;
    if (borrow != nullptr) (*borrow)[w] = slabs;
    short_slabs += slabs;
  }
  if (first_short < 0) return first_short;
  std::int64_t total = 0;
  for (std::size_t v = 0; v < windows_.size(); ++v) {
    const std::int64_t l = available[v] >= need[v]
                               ? Lendable(v, need[v], available[v], keep == nullptr ? nullptr : &(*keep)[v], over_calls)
                               : 0;
    if (lendable != nullptr) (*lendable)[v] = l;
    total += l;
  }
  return total >= short_slabs ? -1 : first_short;
}

void SharedArenaLender::CollectKept(const KeptBlocks& kept) {
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    std::vector<BlockId>& keep = keep_[w];
    keep.clear();
    for (std::int32_t i = kept.front[w]; i < kept.end; ++i) {
      keep.push_back(kept.tree->Block(kept.path[i], static_cast<std::int32_t>(w)));
    }
    if (kept.partial != nullptr) keep.push_back(kept.partial[w]);
  }
}

std::int64_t SharedArenaLender::PlanBlocks(const std::vector<std::int64_t>& need,
                                           const std::vector<std::int64_t>& available, const KeptBlocks* kept) {
  keep_planned_ = kept != nullptr;
  if (keep_planned_) CollectKept(*kept);
  const std::int64_t short_w = FirstUnserved(need, available, keep_planned_ ? &keep_ : nullptr,
                                             /*over_calls=*/false, &borrow_, &lendable_);
  if (short_w >= 0) std::fill(borrow_.begin(), borrow_.end(), 0);
  return short_w;
}

void SharedArenaLender::MoveSlab(std::size_t donor, std::size_t w, std::int32_t slab) {
  windows_[donor]->LendSlab(slab, &displaced_);
  windows_[w]->AdoptSlab(slab);
  ++lent_slabs_;
}

const std::vector<SeqId>& SharedArenaLender::MoveSlabs() {
  displaced_.clear();
  const std::size_t nw = windows_.size();
  for (std::size_t w = 0; w < nw; ++w) {
    for (; borrow_[w] > 0; --borrow_[w]) {
      std::size_t donor = nw;
      for (std::size_t v = 0; v < nw; ++v) {
        if (v != w && lendable_[v] > 0 && (donor == nw || lendable_[v] > lendable_[donor])) donor = v;
      }
      KVC_CHECK(donor < nw, detail::Concat("window ", windows_[w]->window(), " has no slab to borrow"));
      --lendable_[donor];
      MoveSlab(donor, w, windows_[donor]->SlabToLend(keep_planned_ ? &keep_[donor] : nullptr));
    }
  }
  keep_planned_ = false;
  return displaced_;
}

const std::vector<SeqId>& SharedArenaLender::Rebalance() {
  // So the windows evict, in effect, in one order, while inside a step the free blocks the
  // scheduler planned with stay where they were.
  displaced_.clear();
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    WindowBlockManager& wm = *windows_[w];
    // As many scratch blocks as it evicted cached ones in the step, so that the next step's
    // allocations need not evict its cache while other windows hold cheaper blocks.
    const std::int64_t wanted = wm.TakeCachedEvictions();
    while (rebalance_ && wm.policy().NumScratch(CacheLevel::kPrimary) < wanted) {
      const BlockId own = wm.policy().PeekCached(CacheLevel::kPrimary);
      if (own == kNullBlock) break;
      std::size_t donor = windows_.size();
      std::int32_t slab = -1;
      WindowBlockManager::EvictionKey best = wm.EvictionKeyOf(own);
      for (std::size_t v = 0; v < windows_.size(); ++v) {
        if (v == w) continue;
        const WindowBlockManager& dm = *windows_[v];
        const std::int32_t s = dm.CheaperSlab(best);
        if (s < 0) continue;
        donor = v;
        slab = s;
        best = dm.EvictionKeyOf(dm.policy().Peek(CacheLevel::kPrimary));
      }
      if (donor == windows_.size()) break;
      MoveSlab(donor, w, slab);
    }
  }
  return displaced_;
}

bool SharedArenaLender::FitsWhenEmpty(const std::map<WindowSize, std::int32_t>& need,
                                      const std::function<std::size_t(WindowSize)>& index) const {
  std::int64_t slabs = 0;
  for (const auto& [window, n] : need) {
    const WindowBlockManager& wm = *windows_[index(window)];
    if (n > 0) slabs += CeilDiv(n, wm.blocks_per_slab());
  }
  return slabs <= windows_[0]->num_primary() / windows_[0]->blocks_per_slab();
}

std::int32_t SharedArenaLender::FreeBlocks(std::size_t w) const {
  std::int64_t free = windows_[w]->NumFreePrimary();
  for (std::size_t v = 0; v < windows_.size(); ++v) {
    if (v != w) free += static_cast<std::int64_t>(windows_[v]->NumFreeSlabs()) * windows_[w]->blocks_per_slab();
  }
  return static_cast<std::int32_t>(free);
}

void SharedArenaLender::CheckInvariants() const {
  const std::int32_t slabs = windows_[0]->num_primary() / windows_[0]->blocks_per_slab();
  for (std::int32_t k = 0; k < slabs; ++k) {  // the windows' slabs partition the arena
    std::int32_t owners = 0;
    for (const auto& wm : windows_) owners += wm->OwnsSlab(k) ? 1 : 0;
    KVC_CHECK(owners == 1, detail::Concat("slab ", k, " of the shared arena has ", owners, " owners"));
  }
  for (const std::int64_t b : borrow_) KVC_CHECK(b == 0, "planned slab moves outlived their call");
}

}  // namespace

SlabLender::~SlabLender() = default;

std::unique_ptr<SlabLender> SlabLender::Make(const ManagerConfig& config, const std::vector<WindowSize>& window_sizes,
                                             const std::vector<std::vector<PoolLayout>>& window_pools,
                                             MemoryBackend* backend, const Windows& windows) {
  if (config.lend_free_memory && window_sizes.size() > 1) {
    return std::make_unique<SharedArenaLender>(config, window_sizes, window_pools, backend, windows);
  }
  return std::make_unique<NoLending>(windows);
}

}  // namespace kvcache
