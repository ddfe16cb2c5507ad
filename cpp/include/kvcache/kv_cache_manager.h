// The manager façade: sequences, fanned out over one WindowBlockManager per window size (its
// configuration, stats and views: manager_types.h).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvcache/attention_kind.h"
#include "kvcache/block_key.h"
#include "kvcache/block_math.h"
#include "kvcache/events.h"
#include "kvcache/manager_types.h"
#include "kvcache/memory_backend.h"
#include "kvcache/prepared_prompt.h"
#include "kvcache/reuse_tree.h"
#include "kvcache/sequence.h"
#include "kvcache/shared_tier.h"
#include "kvcache/slab_lender.h"
#include "kvcache/state_pool.h"
#include "kvcache/types.h"
#include "kvcache/window_block_manager.h"

namespace kvcache {

/// KV cache manager for models with one or more attention window sizes (VSWA).
///
/// Thread-safe: every public method takes one internal mutex. Every mutating call is
/// check-then-mutate: it either succeeds completely or throws with no state changed.
class KVCacheManager {
 public:
  KVCacheManager(const ModelSpec& model, const ManagerConfig& config);
  ~KVCacheManager();
  KVCacheManager(const KVCacheManager&) = delete;
  KVCacheManager& operator=(const KVCacheManager&) = delete;

  /// Window sizes, ascending and distinct (full attention = max_seq_len).
  const std::vector<WindowSize>& window_sizes() const { return window_sizes_; }
  std::int32_t tokens_per_block() const { return tpb_; }
  std::int32_t max_seq_len() const { return max_seq_len_; }
  std::int32_t max_batch_size() const { return max_batch_size_; }
  std::int32_t max_draft_tokens() const { return max_draft_tokens_; }
  /// Block positions a sequence of max_seq_len tokens spans: ceil(max_seq_len / tpb).
  std::int32_t max_blocks_per_seq() const { return max_blocks_per_seq_; }
  std::int32_t kv_factor() const { return kv_factor_; }
  BackendKind backend() const { return backend_->Kind(); }
  /// Primary (owned now, see lend_free_memory) and secondary blocks per window.
  std::map<WindowSize, WindowBlocks> blocks_per_window() const;
  bool lends_free_memory() const { return lender_->lends(); }
  /// Whether allocating blocks (AddSequence, Prefill, AddTokens, RefreshBlocks under lending) can
  /// copy KV bytes: only with a backend that has memory, and then only to or from a host or disk
  /// tier (evictions offload, admissions onboard), into the copy of a partly matched block, or
  /// from the shared tier (whose lookups also wait on the network).
  /// Without that those calls are bookkeeping alone, and the Python bindings keep the GIL for
  /// them. (Rewind copies a shared tail block whenever the backend has memory.)
  /// After a fork, AddTokens and Prefill may also copy a shared block (copy-on-write).
  bool MayCopyBlocks() const { return may_copy_.load(std::memory_order_relaxed); }
  /// Pools in global order: ascending window, then ascending (KV-head count, head size, dtype)
  /// with dtypes in DType order.
  std::vector<PoolInfo> pools() const;
  /// (global pool index, index of the layer inside its pool) for every layer.
  const std::vector<std::pair<std::int32_t, std::int32_t>>& layer_to_pool() const {
    return layer_to_pool_;
  }

  /// Registers sequence `id` with prompt `tokens[0..n)`: the whole prompt is keyed and looked up
  /// for reuse, and every window gets blocks for the reused prefix plus the first `prefill`
  /// prompt tokens after it (nullopt: the whole prompt; otherwise >= 1). Returns the number of
  /// prompt tokens already cached in every window (0 without reuse).
  std::int32_t AddSequence(SeqId id, const TokenId* tokens, std::size_t n,
                           const SequenceOptions& options = {},
                           std::optional<std::int32_t> prefill = std::nullopt);
  /// AddSequence of a prepared prompt (its extras replace options.extras): no conversion, no
  /// hashing. The sequence keeps a copy of the prompt.
  std::int32_t AddSequence(SeqId id, const PreparedPrompt& prompt, const SequenceOptions& options = {},
                           std::optional<std::int32_t> prefill = std::nullopt);
  /// The same, keeping `prompt` (shared) as the sequence's prompt tokens and keys instead of a
  /// copy of them: nothing of the prompt is copied at admission.
  std::int32_t AddSequence(SeqId id, std::shared_ptr<const PreparedPrompt> prompt, const SequenceOptions& options = {},
                           std::optional<std::int32_t> prefill = std::nullopt);
  /// Converts and keys a prompt once (validated like AddSequence's): see PreparedPrompt.
  PreparedPrompt Prepare(const TokenId* tokens, std::size_t n, const ReuseExtras& extras) const;
  /// The same, taking over `tokens` (no copy).
  PreparedPrompt Prepare(std::vector<TokenId>&& tokens, const ReuseExtras& extras) const;
  /// Chunked prefill: gives blocks for the next `num_tokens` prompt tokens of `id`, first
  /// releasing every sliding-window block that no query of the chunk can attend (the decode
  /// rule at the chunk's first position). All or nothing.
  void Prefill(SeqId id, std::int32_t num_tokens);
  /// The same for a step's chunks in one call: num_tokens[i] more prompt tokens for ids[i].
  /// Every sequence releases before any hands out, so a block that several of them release is
  /// credited once all its holders let it go. All or nothing.
  void Prefill(const SeqId* ids, const std::int32_t* num_tokens, std::size_t n);
  /// Prompt tokens of `id` (NumTokens counts the tokens that have blocks).
  std::int32_t PromptLength(SeqId id) const;
  /// Appends one generated token to `id`.
  void AddToken(SeqId id, TokenId token);
  /// Appends tokens[i] to ids[i] for a whole batch; all or nothing.
  void AddTokens(const SeqId* ids, const TokenId* tokens, std::size_t n);
  /// FirstLengthMismatch(ids, lengths, n), then, if it is -1, AddTokens(ids, tokens, n): one
  /// lookup per sequence for both (a decode step's check and append under one lock). Returns
  /// the first mismatch (nothing added) or -1 once added; AddTokens' errors as AddTokens.
  std::int64_t AddTokensIfLengths(const SeqId* ids, const TokenId* tokens, const std::int32_t* lengths,
                                  std::size_t n);
  /// Ends sequence `id`: with reuse on (and the sequence valid, or under kPlaceholder) stores its
  /// blocks in the reuse tree first; `pin` (needs reuse) keeps the stored blocks referenced until
  /// unpinned and returns the pinned blocks per window (empty lists otherwise).
  std::map<WindowSize, std::vector<BlockId>> RemoveSequence(SeqId id, bool store_for_reuse = true,
                                                            bool pin = false);
  /// Stores the sequence's full prompt blocks now (at most its first num_tokens - 1 tokens);
  /// returns the block positions newly stored.
  std::int32_t StoreContextBlocks(SeqId id);
  /// The same for several sequences (each id once); returns the positions stored in all.
  /// Every id is checked before anything is stored.
  std::int64_t StoreContextBlocks(const SeqId* ids, std::size_t n);
  /// Stores the sequence's full blocks and pins, in every window, the cached block of each stored
  /// position. Returns the pinned blocks per window: exactly what UnpinBlocks takes.
  std::map<WindowSize, std::vector<BlockId>> PinBlocks(SeqId id);
  /// Drops one pin of each listed block of each window (as PinBlocks / RemoveSequence returned
  /// them). All or nothing: a block without that many pins raises std::invalid_argument.
  void UnpinBlocks(const std::map<WindowSize, std::vector<BlockId>>& pinned);
  /// Legacy form: unpins the chain ending at each block (and its ancestors) in `window`, or in
  /// every window when `window` is nullopt (block ids are then those of the full-attention window).
  void UnpinBlocksById(const std::vector<BlockId>& blocks, std::optional<WindowSize> window);
  /// Once per engine step: timed priorities that expired return to the default; copies finish.
  /// Under lend_free_memory also moves slabs towards windows that evicted cached blocks in the
  /// step, from windows whose next victims are cheaper to lose (see Rebalance).
  void RefreshBlocks();
  /// Drops every cached prefix (vLLM's reset_prefix_cache: after a weight update, for
  /// benchmarks). Returns false, changing nothing, while any sequence is registered or any block
  /// is pinned. Otherwise every window's cached blocks leave the reuse tree through the eviction
  /// drop (WindowBlockManager::Drop, so `removed` events are emitted as for an eviction): primary
  /// ones become plain free blocks, secondary (host) blocks and disk slots are freed, the tree is
  /// left with its root alone, and true is returned (also without reuse, where nothing is cached).
  /// The shared tier (Redis) is not touched: its blocks stay in the store and still serve hits
  /// past an empty local cache. Cumulative counters (reused, missed, offloaded, ...) are kept.
  bool ResetPrefixCache();
  /// What AddSequence would return now for this prompt, without changing anything. With a shared
  /// tier, the store is probed as AddSequence's lookup first probes it (one pipelined EXISTS
  /// round trip within shared_cache_timeout_ms; a failure is a miss, counted, never thrown);
  /// the blocks' bytes are not read, so a block that would fail verification still counts.
  std::int32_t GetReusablePrefixLength(const TokenId* tokens, std::size_t n, const ReuseExtras& extras) const;
  std::int32_t GetReusablePrefixLength(const PreparedPrompt& prompt) const;
  /// Free primary blocks per window that AddSequence of this prompt would take now (reused
  /// blocks that are referenced cost nothing; cached free ones, onboards and fresh ones one each).
  /// With `prefill`, for the first chunk only (as AddSequence with that `prefill`).
  std::map<WindowSize, std::int32_t> GetNumBlocksToAllocate(
      const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
      std::optional<std::int32_t> prefill = std::nullopt) const;
  std::map<WindowSize, std::int32_t> GetNumBlocksToAllocate(
      const PreparedPrompt& prompt, std::optional<std::int32_t> prefill = std::nullopt) const;
  bool IsSequenceValidForReuse(SeqId id) const;
  RequestStats GetRequestStats(SeqId id) const;
  /// Buffered events (empty without an event buffer); waits up to `timeout_ms` for one.
  std::vector<KVCacheEvent> GetLatestEvents(std::int64_t timeout_ms);
  bool reuse_enabled() const { return reuse_; }
  /// Chained hashes of the tree nodes that hold a block of `window` (sorted): what a consumer
  /// of the event stream should believe is cached there. For tests and debugging; O(nodes).
  std::vector<std::uint64_t> CachedBlockHashes(WindowSize window) const;
  /// Test hook: a fixed clock for timed priorities (negative: the real steady clock).
  void SetFakeTimeMs(std::int64_t now_ms);
  /// Drops the last `num_tokens` tokens of `id`, releasing blocks that become empty.
  void Rewind(SeqId id, std::int32_t num_tokens);
  /// Registers each children[i] as a copy of sequence `parent` (beam search, parallel sampling):
  /// same tokens, prompt, options and reuse state, sharing every block the parent holds in every
  /// window (one more reference each, no block taken, nothing copied) and the parent's release
  /// records. A later write into a block that is not private (AddTokens, Prefill, Rewind into it)
  /// first gives the writer a private copy of the block's tokens (copy-on-write). Unknown parent:
  /// UnknownSequenceError; a child id < 0, equal to the parent, registered or repeated:
  /// std::invalid_argument; more than max_batch_size sequences: KVCacheError. All or nothing.
  void ForkSequence(SeqId parent, const SeqId* children, std::size_t n);

  std::int32_t NumTokens(SeqId id) const;
  bool HasSequence(SeqId id) const;
  std::size_t NumSequences() const;
  /// Block list of `id` in `window`: one entry per block position, kNullBlock where released.
  std::vector<BlockId> GetCacheBlockIds(SeqId id, WindowSize window) const;
  /// Primary blocks of `window` that can be handed out now (with lend_free_memory: its own free
  /// blocks plus those the other windows' wholly free slabs would give it, if it alone asked).
  std::int32_t GetNumFreeBlocks(WindowSize window) const;
  /// Minimum of GetNumFreeBlocks over all windows.
  std::int32_t GetMinNumFreeBlocks() const;
  /// Whether every window can hand out `need[window]` blocks at once now (windows not named need
  /// none; a negative entry is a credit: the window frees that many blocks first, as a decode
  /// step's releases do): GetNumFreeBlocks per window, except that under lend_free_memory the
  /// windows compete for the same lendable slabs. Meant for a whole engine step (several
  /// calls): a donor with several blocks per slab is assumed to take its own blocks first,
  /// each breaking one wholly free slab.
  bool CanAllocate(const std::map<WindowSize, std::int32_t>& need) const;
  /// Whether an empty manager could hold `need[window]` blocks of every window at once: each
  /// window's pool, or under lend_free_memory the whole arena in whole slabs.
  bool FitsWhenEmpty(const std::map<WindowSize, std::int32_t>& need) const;
  /// Primary blocks of `window` referenced by sequences or pins.
  std::int32_t GetNumUsedBlocks(WindowSize window) const;

  /// Fills `out` (int32, C-contiguous `[num_pools, rows, kv_factor, width]`) for a batch.
  /// Row `slot_offset + i` belongs to ids[i]; the entry of pool p, field k (0 = K, 1 = V) and
  /// block position j is `block_id * layers_in_pool * kv_factor + k`, or kOffsetSentinel for a
  /// released position and for positions past the sequence's end up to the returned width.
  /// Returns the widest row written (the most block positions of any sequence in the batch).
  std::int32_t CopyBlockOffsets(std::int32_t* out, std::int64_t rows, std::int64_t width,
                                const SeqId* ids, std::size_t n, std::int64_t slot_offset) const;

  // ---- Recurrent state (kv_cache_manager_state.cpp).
  /// State groups, in order of their first layer.
  std::vector<StateGroupInfo> state_groups() const;
  std::size_t num_state_groups() const { return states_.size(); }
  /// The kind of window `w` (index into window_sizes()).
  const AttentionKind& window_kind(std::size_t w) const { return *kinds_[w]; }
  /// The working slot of `id` in state group `group`.
  std::int32_t GetStateSlot(SeqId id, std::int32_t group) const;
  /// Strided view of tensor `tensor` of recurrent layer `layer`; throws on the virtual backend.
  StateView GetStateView(std::int32_t layer, std::int32_t tensor) const;
  /// The checkpoint copies of the step about to run, for an engine that copies states itself:
  /// each copies a sequence's working slot into a checkpoint slot, and must run after the
  /// forward pass of this step (which ends the working state at the checkpoint position) and
  /// before the next call that stores blocks (StoreContextBlocks, RemoveSequence). Forgets them
  /// (a removed sequence's are dropped). Restores, forks and zeroing are done by the manager.
  void TakeStateCopies(std::vector<StateCopy>* after);
  /// The same copies made by the manager itself, on its backend (after the forward pass).
  /// Returns how many.
  std::int64_t SaveCheckpoints();
  /// The largest chunk of at most `num_tokens` prompt tokens that registered sequence `id` may
  /// prefill next without straddling a checkpoint it is to take (num_tokens without one).
  std::int32_t GetChunkLimit(SeqId id, std::int32_t num_tokens) const;
  /// The same for the first chunk (after its reused prefix) of a prompt not registered yet.
  std::int32_t GetPromptChunkLimit(const PreparedPrompt& prompt, std::int32_t num_tokens) const;
  /// How far each kind of group could resume this prompt now (no shared-tier probe).
  ReusableByKind GetReusableByKind(const PreparedPrompt& prompt) const;
  const CheckpointPolicy& checkpoint_policy() const { return checkpoint_policy_; }

  /// Strided view of layer `layer`'s primary memory; throws on the virtual backend.
  LayerView GetLayerView(std::int32_t layer) const;

  KvCacheStats GetStats() const;
  /// Verifies every invariant; throws InternalError describing the first violation.
  void CheckInvariants() const;

  // ---- Estimates for a scheduler, from the real state (kv_cache_manager_estimates.cpp). Each
  // returns one count per window, ascending, computed with block_math.h's rules under the
  // manager's mutex. A chunk size <= 0 means "the whole rest of the prompt in one chunk".

  /// Free blocks each window must have for one engine step as an engine runs it: first the
  /// generation tokens of `gen_ids` (gen_tokens[i] = 1 + draft tokens, appended by one AddTokens
  /// call per token position, where a block one sequence releases serves any sequence of the same
  /// call), then the prefill chunks (chunk_ids[i] gets chunk_tokens[i] more prompt tokens, each
  /// crediting only its own releases). The worst point of the step; a released block that
  /// another holder (sequence or pin) also holds frees nothing and is not credited.
  std::vector<std::int64_t> GetStepNeeds(const SeqId* gen_ids, const std::int32_t* gen_tokens, std::size_t num_gen,
                                         const SeqId* chunk_ids, const std::int32_t* chunk_tokens,
                                         std::size_t num_chunks) const;
  /// Free blocks the next step of registered sequence `id` takes: `num_tokens` more tokens (a
  /// chunk of its prompt while in prefill, <= 0: the rest; else its newest token plus drafts).
  /// With `credit_releases`, less what its sliding windows release at the step's worst point.
  std::vector<std::int64_t> GetSequenceStepNeeds(SeqId id, std::int32_t num_tokens, bool credit_releases) const;
  /// Summed over registered sequences ids[i]: the free blocks each may still take before it holds
  /// final_tokens[i] tokens (with `prefill_only`: before its prompt is prefilled), the rest of its
  /// prompt in chunks of at most `chunk` tokens: the peak of what it will hold less what it holds.
  /// `final_tokens` null: each sequence's own (SetFinalTokens; max_seq_len when not set).
  std::vector<std::int64_t> GetRemainingBlocks(const SeqId* ids, const std::int32_t* final_tokens, std::size_t n,
                                               std::int32_t chunk, bool prefill_only) const;
  /// GetRemainingBlocks (not prefill_only) and GetProgress of the same sequences in one pass.
  std::vector<std::int64_t> GetRemainingBlocks(const SeqId* ids, const std::int32_t* final_tokens, std::size_t n,
                                               std::int32_t chunk, std::int32_t* num_tokens,
                                               std::int32_t* prompt_len) const;
  /// Records that sequence `id` will hold at most `final_tokens` tokens (its prompt plus
  /// max_new_tokens - 1): what GetRemainingBlocks assumes when given no final lengths.
  void SetFinalTokens(SeqId id, std::int32_t final_tokens);
  /// The same for a prompt not registered yet, growing to `final_tokens` tokens: registering it
  /// now (its reuse plan: GetNumBlocksToAllocate) plus its growth; `use_reuse` false (with reuse
  /// on): the bound over whatever the cache holds when it registers.
  /// `reusable` (optional) receives the local reuse plan's tokens (GetReusablePrefixLength
  /// without the shared tier's probe), from the same lookup.
  std::vector<std::int64_t> GetPromptRemainingBlocks(const PreparedPrompt& prompt, std::int32_t final_tokens,
                                                     std::int32_t chunk, bool use_reuse, bool prefill_only,
                                                     std::int32_t* reusable = nullptr) const;
  /// Free blocks registering `prompt` with a first chunk of `chunk` tokens after its reused prefix
  /// takes now (GetNumBlocksToAllocate); with `credit_releases`, a sliding window is charged every
  /// position the chunk holds (sharing reused blocks voids their holders' release credits);
  /// `use_reuse` false (with reuse on): the bound over every reused prefix.
  std::vector<std::int64_t> GetPromptStepNeeds(const PreparedPrompt& prompt, std::int32_t chunk,
                                               bool credit_releases, bool use_reuse) const;
  /// Most blocks a sequence with a `prompt_len`-token prompt holds from registration until it
  /// holds `final_tokens` tokens, nothing reused, the prompt in chunks of at most `chunk` tokens:
  /// what it needs from an otherwise empty pool.
  std::vector<std::int64_t> GetBlocksToRunAlone(std::int32_t prompt_len, std::int32_t final_tokens,
                                                std::int32_t chunk) const;
  /// Per window: the most free blocks one more beam forked (ForkSequence) from a sequence of
  /// `fork_tokens` tokens takes before it holds `final_tokens` tokens (block_math::ForkedBeamBlocks):
  /// its copy of the shared partial block and its own new blocks, never the shared ones.
  std::vector<std::int64_t> GetForkedBeamBlocks(std::int32_t fork_tokens, std::int32_t final_tokens) const;
  /// Extra references of blocks held more than once in a window that releases blocks (sequences
  /// and pins): the releases the per-sequence estimates credit but that free nothing.
  std::int64_t GetNumSharedBlocks(WindowSize window) const;
  /// A beam family's blocks to completion, its shared blocks counted once: the `n` registered
  /// sequences `ids` (beams of one request, none in prefill, all holding the same tokens and
  /// released front) grow in lockstep to `final_tokens` tokens. Per window, `remaining` gets the
  /// most free blocks they take together (each beam's copy of a shared partial block, when the
  /// last writer does not keep it, and its own new blocks; a held block is credited when the
  /// family releases it only if no one else holds it) and `family_refs` the family's own extra
  /// holdings of its shared blocks in windows that release blocks (the part of
  /// GetNumSharedBlocks that `remaining` already accounts for). Returns false, changing nothing,
  /// if the sequences are not in lockstep.
  bool GetFamilyRemainingBlocks(const SeqId* ids, std::size_t n, std::int32_t final_tokens,
                                std::vector<std::int64_t>* remaining, std::vector<std::int64_t>* family_refs) const;
  /// Blocks sequence `id` holds in `window` now (released positions not counted).
  std::int32_t GetNumHeldBlocks(SeqId id, WindowSize window) const;
  /// For each registered sequence ids[i]: the tokens that have blocks and its prompt length
  /// (NumTokens and PromptLength of a batch under one lock).
  void GetProgress(const SeqId* ids, std::size_t n, std::int32_t* num_tokens, std::int32_t* prompt_len) const;
  /// The first i whose sequence ids[i] is not registered or does not hold lengths[i] tokens
  /// (NumTokens), or -1: an engine's batch check that its requests and the cache agree.
  std::int64_t FirstLengthMismatch(const SeqId* ids, const std::int32_t* lengths, std::size_t n) const;
  /// The indices i, ascending, whose sequence ids[i] holds at least its final tokens
  /// (SetFinalTokens; never for a sequence without them): after a step's tokens were added,
  /// the requests whose token sampled in that step is their last. Throws std::out_of_range
  /// (KeyError) for an unregistered id, before anything is returned.
  std::vector<std::int64_t> ReachedFinalTokens(const SeqId* ids, std::size_t n) const;
  /// The shared tier's key prefix (empty without a shared tier).
  std::string shared_cache_namespace() const { return shared_ != nullptr ? shared_->ns() : std::string(); }
  /// Waits up to `timeout_ms` until every block queued for the shared tier was written (or
  /// failed); true if the queue drained (and without a shared tier).
  bool FlushSharedCache(std::int32_t timeout_ms);

 private:
  // ---- Construction (kv_cache_manager.cpp; pools: pool_layout.cpp).
  /// The pools of every window (its layers of one shape share a pool, one block holds all of
  /// them); fills layer_to_pool_ and pool_index_.
  std::vector<std::vector<PoolLayout>> PlanPools(const ModelSpec& model, const std::vector<WindowSize>& layer_window);
  /// Makes the lender (under lend_free_memory it plans and allocates the shared arena), creates
  /// the windows in the memory it gives them, their disk tiers and pin tables, and emits their
  /// created events.
  void MakeWindows(const ManagerConfig& config, std::vector<std::vector<PoolLayout>> window_pools);

  struct ReusePlan {
    std::vector<NodeId> path;        // nodes of the matched full blocks
    std::int32_t full_blocks = 0;    // P: full blocks every window can serve
    NodeId partial = kNoNode;        // node whose first tokens are reused after them
    std::int32_t partial_tokens = 0;
    std::vector<BlockId> partial_src;     // per window
    std::vector<char> partial_takeover;   // per window: take the block over instead of copying
    std::int32_t reused_tokens = 0;
    std::int32_t shared_blocks = 0;  // full blocks after full_blocks that the shared tier serves
    // With state groups (else equal to full_blocks): blocks full attention serves, and with the
    // sliding windows too; full_blocks is then where every state group has a checkpoint.
    std::int32_t attention_blocks = 0;
    std::int32_t full_attention_blocks = 0;
    std::vector<SlotId> restore;  // per state group: the checkpoint at full_blocks (kNoSlot at 0)
  };
  struct WindowCounters {
    std::int64_t alloc_total = 0;
    std::int64_t alloc_new = 0;
    std::int64_t reused = 0;
    std::int64_t missed = 0;
    std::int64_t forked = 0;  // references taken by ForkSequence
    std::int64_t copied = 0;  // copy-on-write copies
  };

  Sequence& Find(SeqId id);
  const Sequence& Find(SeqId id) const;
  std::size_t WindowIndex(WindowSize window) const;
  /// Number of leading block positions a sliding window may have released at `num_tokens`.
  std::int32_t ReleaseTarget(std::size_t w, std::int32_t num_tokens) const {
    return block_math::Released(num_tokens, keep_[w], tpb_);
  }
  /// Blocks of `seq` in window `w` from its released front up to position `target` that another
  /// holder also holds: releasing them frees nothing.
  std::int32_t SharedReleases(const Sequence& seq, std::size_t w, std::int32_t target) const;
  /// 1 if the next token of `seq` (decoded or prefilled) lands in a block of window `w` that is
  /// not private (shared with a fork, cached or recorded): its copy-on-write takes a block.
  std::int32_t CopyNeed(const Sequence& seq, std::size_t w) const;
  /// Of the CopyNeed of the sequences `ids` writing one token each in one AddTokens call, the
  /// copies that do not happen: a shared partial block whose writers are all its holders (not in
  /// the reuse tree, no release records) stays with its last writer (CountBatchCopies's rule).
  std::int64_t KeptCopies(const SeqId* ids, std::size_t n, std::size_t w) const;
  /// Free blocks window `w` has lost to `seq` after appending token `m` (its allocations less
  /// its private releases; negative when it frees).
  std::int64_t DecodeDelta(const Sequence& seq, std::size_t w, std::int64_t m) const;
  /// Free blocks a chunk of `size` tokens of `seq` takes from window `w` (with `credit`: less its
  /// private releases).
  std::int64_t ChunkNeed(const Sequence& seq, std::size_t w, std::int32_t size, bool credit) const;
  /// Registration of `prompt` with a first chunk of `size` tokens, per window (the lock held).
  void PromptRegistration(const PreparedPrompt& prompt, std::int64_t size,
                          std::vector<block_math::Registration>* out) const;
  /// Releases the front blocks of `seq` in window `w` that are out of window for a sequence of
  /// `num_tokens` tokens.
  void ReleaseFront(Sequence& seq, std::size_t w, std::int32_t num_tokens) {
    // ReleaseTarget(w, num_tokens) > front_null, without its division: most calls (a decode
    // step inside a block, or full attention) release nothing.
    if (num_tokens >= static_cast<std::int64_t>(seq.windows[w].front_null) * tpb_ + release_base_[w]) {
      ReleaseFrontFrom(seq, w, num_tokens);
    }
  }
  void ReleaseFrontFrom(Sequence& seq, std::size_t w, std::int32_t num_tokens);
  /// Blocks of window `w` that the sequences of batch_ free when each releases what a sequence
  /// one token longer than now no longer attends (a decode step's and a chunk's release rule).
  /// A block several of them hold is freed only if all its holders are in the batch.
  std::int64_t FreedByBatchReleases(std::size_t w);
  /// The start of a batch call (AddTokens, Prefill, StoreContextBlocks): batch_ holds n entries,
  /// filled by BatchMember, and a new stamp tells repeated ids apart.
  void BeginBatch(std::size_t n);
  /// Entry i of the batch: the sequence `id` (UnknownSequenceError if there is none,
  /// std::invalid_argument if the call already named it).
  Sequence& BatchMember(std::size_t i, SeqId id, const char* call) {  // inline: once per sequence per step
    return MarkMember(i, Find(id), call);
  }
  /// BatchMember for a sequence already found.
  Sequence& MarkMember(std::size_t i, Sequence& seq, const char* call) {
    if (seq.batch_stamp == stamp_) ThrowRepeated(seq.id, call);
    seq.batch_stamp = stamp_;
    batch_[i] = &seq;
    return seq;
  }
  /// GetRemainingBlocks, with GetProgress's outputs when num_tokens / prompt_len are not null.
  std::vector<std::int64_t> GetRemainingBlocksImpl(const SeqId* ids, const std::int32_t* final_tokens, std::size_t n,
                                                   std::int32_t chunk, bool prefill_only, std::int32_t* num_tokens,
                                                   std::int32_t* prompt_len) const;
  /// AddTokens' body (the caller holds mu_ and called BeginBatch(n)); `found`: batch_[0..n)
  /// already holds the sequences of ids (looked up by the caller), else they are looked up.
  void AddTokensLocked(const SeqId* ids, const TokenId* tokens, std::size_t n, bool found);
  [[noreturn]] static void ThrowRepeated(SeqId id, const char* call);
  /// Whether every window w can hand out check_need_[w] blocks once the batch's releases are
  /// counted (slab borrowing planned by the lender): -1 if so, else the first window that cannot;
  /// check_available_ then holds what each window can give.
  std::int64_t ShortWindowForBatch();
  /// Carries out the lender's plan (SlabLender::MoveSlabs) before a call changes anything else;
  /// sequences that had released a lent block out of window become invalid for reuse.
  void MoveSlabs();
  /// StoreContextBlocks of one sequence (the caller holds mu_).
  std::int32_t StoreContext(Sequence& seq);
  /// Tokens with blocks after AddSequence of an `n`-token prompt with `reused` tokens reused.
  /// (`prefill`, when given, is >= 1: callers validate it first.)
  std::int32_t FirstChunkEnd(std::size_t n, std::int32_t reused, std::optional<std::int32_t> prefill) const;
  std::int64_t NowMs() const;
  /// Priority and expiry of block position `j` of `seq`, and the end of the run of positions
  /// from `j` (before `last`) that take the same ones.
  struct BlockPriorityRun {
    int priority;
    std::int64_t expiry_ms;
    std::int32_t end;
  };
  BlockPriorityRun BlockPriority(const Sequence& seq, std::int32_t j, std::int32_t last) const;

  /// How a block reaches a sequence position (see Attach).
  enum class Handout : std::uint8_t {
    kShare,     ///< cached block `b` (any level), read-only: one more reference
    kTakeOver,  ///< free primary block `b` whose first tokens are reused, made private and writable
    kOnboard,   ///< the claimed secondary block at that position moves into a fresh primary block
  };
  /// How a block leaves a sequence position (see Detach).
  enum class Leave : std::uint8_t {
    kOutOfWindow,  ///< a sliding window moved past it: the sequence keeps a record of its content
    kRewind,       ///< rewound tokens: the block goes to the front of the scratch queue
    kEnd,          ///< the sequence ends
  };
  /// The one door through which a cached or claimed block reaches a sequence: position `j` of
  /// `seq` in window `w` gets a block as `how` says and the block id is stored there. Writable
  /// hand-outs go through WindowBlockManager::Grant (generation bumped) and
  /// invalidate every other live sequence that had released the block out of window. Returns
  /// the block.
  BlockId Attach(Sequence& seq, std::size_t w, std::int32_t j, Handout how, BlockId b = kNullBlock);
  /// The one door through which fresh blocks reach a sequence: the empty positions
  /// [first, last) of `seq` in window `w` get the next free primary blocks (the eviction
  /// victims, writable), in position order, by WindowBlockManager::AcquireN (one call per run of
  /// positions with the same priority); every other live sequence that had released one of
  /// them out of window is invalidated.
  void AttachFresh(Sequence& seq, std::size_t w, std::int32_t first, std::int32_t last);
  /// The one door through which blocks leave a sequence: positions [first, last) of `seq` in
  /// window `w` give up their blocks, the newest first (kOutOfWindow: the oldest first, from the
  /// front, which moves and records (block, generation) per position).
  void Detach(Sequence& seq, std::size_t w, std::int32_t first, std::int32_t last, Leave why);
  /// Drops the sequence's release records from the blocks' releaser lists (it is ending).
  void ForgetReleases(const Sequence& seq);
  /// The one door through which sequences lose released content: every live sequence in
  /// `releasers` but `except` had released a block out of window that is now someone else's (a
  /// `what` block: "granted" to a sequence, or "lent" to another window) and becomes invalid
  /// for reuse.
  void InvalidateReleasers(const std::vector<SeqId>& releasers, SeqId except, const char* what);
  /// True if block position `j` of `seq` in window `w` may be written in place: no other holder,
  /// no cached identity and no other sequence's record of its content.
  bool IsPrivate(const Sequence& seq, std::size_t w, std::int32_t j) const;
  /// The one door of copy-on-write: position `j` of `seq` in window `w`, not private, gets a fresh
  /// block (AttachFresh) holding a copy of the first `num_tokens` tokens of the block it held
  /// (held until copied). Precondition: a free block.
  void CopyOnWrite(Sequence& seq, std::size_t w, std::int32_t j, std::int32_t num_tokens);
  /// The copies a batch call's writes into existing blocks take, added to check_need_ per
  /// window: batch_write_[i] >= 0 is the block position that batch_[i] writes into in place. A
  /// block several members write takes one copy per writer, less one if they are all its holders
  /// and nothing else records it (the last writer then finds it private).
  /// Returns the copies summed over windows.
  std::int64_t CountBatchCopies();
  /// Carries out the copies CountBatchCopies counted, in batch order (after the releases).
  void CopyBatchWrites();

  // ---- Admission (kv_cache_manager_admission.cpp).
  /// What AddSequence of one prompt hands out, from its reuse plan.
  struct Admission {
    std::int32_t first = 0;          // tokens with blocks once registered: reused prefix + first chunk
    std::int32_t num_blocks = 0;     // block positions they span
    std::int32_t prompt_blocks = 0;  // block positions of the whole prompt
    std::int32_t full = 0;           // reused full blocks (the plan's full_blocks)
    std::int32_t has_partial = 0;    // 1 if the block after them is partly reused
    std::int32_t shared = 0;         // full blocks after them read from the shared tier
  };
  /// Per window: the free blocks that a prompt of `num_blocks` blocks with reuse plan `plan`
  /// takes (into prompt_need_) and the positions a sliding window leaves empty in front (into
  /// prompt_front_).
  void PromptBlocksNeeded(const ReusePlan& plan, std::int32_t num_blocks) const;
  /// Plans registering a prompt with a first chunk of `prefill` tokens (nullopt: whole): the
  /// reuse plan (plan_), prompt_need_ and prompt_front_. Returns the tokens with blocks after it.
  std::int32_t PlanPromptBlocks(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                                const PreparedPrompt* prepared, std::optional<std::int32_t> prefill) const;
  std::int32_t AddSequenceLocked(SeqId id, const TokenId* tokens, std::size_t n, const SequenceOptions& options,
                                 std::optional<std::int32_t> prefill, std::shared_ptr<const PreparedPrompt> prepared);
  /// AddSequence's argument checks, in order: the id, the prompt (unless `prepared`: checked
  /// already), priorities, multimodal items, max_batch_size, prefill.
  void ValidateAdmission(SeqId id, const TokenId* tokens, std::size_t n, const SequenceOptions& options,
                         const ReuseExtras& extras, std::optional<std::int32_t> prefill, bool prepared) const;
  static void ValidatePriorities(SeqId id, const SequenceOptions& options);
  Admission PlanAdmission(const ReusePlan& plan, std::size_t n, std::optional<std::int32_t> prefill) const;
  /// The blocks check of AddSequence: fills prompt_need_ and prompt_front_, and has the lender
  /// plan (keeping the blocks the plan reuses); throws OutOfBlocksError for a short window.
  void CheckAdmissionBlocks(SeqId id, std::size_t n, const ReusePlan& plan, const Admission& a);
  /// The new sequence `id` with its prompt and options and no blocks yet (block lists sized
  /// per window, empty).
  Sequence& RegisterSequence(SeqId id, const TokenId* tokens, std::size_t n, const SequenceOptions& options,
                             const ReuseExtras& extras, std::shared_ptr<const PreparedPrompt> prepared,
                             const Admission& a, std::int32_t reused);
  /// Sets up `seq`'s block lists and claims every block the plan reuses (and holds a partial
  /// source that is copied, where holding it costs no free block: (*src_held)[w]).
  void ClaimReused(Sequence& seq, const ReusePlan& plan, const Admission& a, std::vector<char>* src_held);
  /// Window `w`'s blocks of a new sequence past the claimed ones: the copy of a partly reused
  /// block (unless taken over), onboards of reused blocks in a lower tier, fresh blocks for the
  /// rest of the first chunk. Returns the blocks taken from the free queues. Releases a held
  /// partial source once copied and clears *src_held. Throws DiskReadError from a disk read.
  std::int64_t HandOutPrompt(Sequence& seq, std::size_t w, const ReusePlan& plan, const Admission& a, char* src_held);
  /// One admission round of registered `seq` after its checks: claims, slab moves, hand-outs,
  /// counters, then waits for the copies. Throws DiskReadError (the round is then undone by
  /// UndoAdmission).
  void Admit(Sequence& seq, const ReusePlan& plan, const Admission& a, std::vector<char>* src_held);
  /// Undoes a round Admit left by DiskReadError: releases every block `seq` holds and the
  /// partial sources still held, and unregisters `seq`. What the round moved stays moved
  /// (onboarded blocks are cached primary blocks now; evictions and slab moves stand).
  void UndoAdmission(Sequence& seq, const ReusePlan& plan, const std::vector<char>& src_held);
  /// The reuse and allocation counters of window `w` (and of `seq`) after an admission that took
  /// `fresh` free blocks there.
  void CountAdmission(Sequence& seq, std::size_t w, const Admission& a, std::int64_t fresh);
  std::map<WindowSize, std::int32_t> BlocksToAllocateLocked(const TokenId* tokens, std::size_t n,
                                                            const ReuseExtras& extras,
                                                            std::optional<std::int32_t> prefill,
                                                            const PreparedPrompt* prepared) const;
  /// A prepared prompt must come from a manager with this block size and fit max_seq_len.
  void CheckPrepared(const PreparedPrompt& prompt) const;
  void ValidatePrefill(std::optional<std::int32_t> prefill, const char* who, SeqId id) const;
  /// Multimodal items need start >= 0 and length >= 0; messages name `id` (>= 0) or `who`.
  void ValidateMultimodal(const ReuseExtras& extras, const char* who, SeqId id) const;
  /// Validates a prompt handed to AddSequence (id >= 0) or a query (`who`, id < 0): non-empty, at
  /// most max_seq_len tokens, no negative token. Messages are built only on error.
  void ValidatePrompt(const TokenId* tokens, std::size_t n, const char* who, SeqId id) const;

  // ---- The shared tier (kv_cache_manager_shared.cpp).
  /// What one admission found in the shared tier: the blocks past the local hit `base` (-1:
  /// none looked up) that every window can serve, and their verified bytes per window
  /// (values[w][d - base]; empty where window w does not need position d).
  struct SharedFetch {
    std::int32_t base = -1;
    std::int32_t blocks = 0;
    std::vector<std::vector<std::string>> values;
  };
  /// Checks the shared tier of `config` (if any), labels the windows' keys and starts it (its
  /// writer thread; the store is first contacted by a lookup or a write).
  void MakeSharedTier(const ManagerConfig& config, const std::vector<std::vector<PoolLayout>>& pools);
  /// `kvcache:` and 16 hex digits: a hash of what makes two managers' blocks interchangeable.
  std::string SharedFingerprint(const std::vector<std::vector<PoolLayout>>& pools) const;
  /// Looks up the prompt's full blocks past plan_.full_blocks in the store (EXISTS, then GET of
  /// what the longest servable prefix needs), verifies them and records them in shared_fetch_.
  /// A failure or a timeout is a miss (counted); it never throws for the store.
  void FetchShared(const TokenId* tokens, std::size_t n, const ReuseExtras& extras, const PreparedPrompt* prepared);
  /// Round 1 of a lookup: avail[w][d - base] = 1 where the store has window w's block at position
  /// d in [base, end), one pipelined EXISTS by `deadline`; false on a failure (a miss, counted).
  bool SharedAvailable(const std::vector<std::uint64_t>& hashes, std::int32_t base, std::int32_t end,
                       std::int64_t deadline, std::vector<std::vector<char>>* avail) const;
  /// The prefix end (in blocks, >= base) the store's blocks serve past a local hit of `base`
  /// blocks: FetchShared's first round, without reading bytes. A failure is `base`.
  std::int32_t ProbeShared(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                           const PreparedPrompt* prepared, std::int32_t base) const;
  /// GetReusablePrefixLength's answer (the caller holds mu_): the local plan, extended by the
  /// store's blocks as ApplyShared extends it.
  std::int32_t ReusableWithShared(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                                  const PreparedPrompt* prepared) const;
  /// The chained hashes of the prompt's first `num_full` full blocks.
  std::vector<std::uint64_t> PromptHashes(const TokenId* tokens, const ReuseExtras& extras,
                                          const PreparedPrompt* prepared, std::int32_t num_full) const;
  /// The longest prefix end h in (base, end] such that every window has avail[w][d - base] for
  /// the positions it needs at h (a sliding window only those its front leaves); base if none.
  std::int32_t SharedServed(const std::vector<std::vector<char>>& avail, std::int32_t base, std::int32_t end) const;
  /// The first position window `w` holds for a prefix of `h` reused blocks.
  std::int32_t FrontAt(std::size_t w, std::int32_t h) const;
  /// Extends plan_ by shared_fetch_ when that starts where the local hit ends.
  void ApplyShared();
  /// Copies the fetched bytes into `seq`'s fresh blocks at positions [first, last) of window w.
  void FillShared(Sequence& seq, std::size_t w, std::int32_t first, std::int32_t last);
  /// Queues block `b` of window `w` (chained hash `hash`) for the store: its bytes are copied now.
  bool WriteShared(std::size_t w, std::uint64_t hash, BlockId b);  // true: queued for the store

  // ---- Reuse (kv_cache_manager_reuse.cpp).
  /// The reuse plan of a prompt; `prepared` (optional) supplies the block digests and hashes.
  /// Valid until the next call (it is the member plan_); an empty plan without reuse.
  const ReusePlan& PlanReuse(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                             const PreparedPrompt* prepared = nullptr) const;
  /// The tree nodes matching the prompt's first full blocks (at most `num_full`), appended to
  /// *path.
  void MatchFullBlocks(const TokenId* tokens, std::int32_t num_full, const ReuseExtras& extras,
                       const PreparedPrompt* prepared, std::vector<NodeId>* path) const;
  /// The longest block-aligned prefix of `path` that every window can serve.
  /// `full_cut` (optional) receives the longest prefix full attention alone serves.
  std::int32_t ServedPrefix(const std::vector<NodeId>& path, std::int32_t* full_cut = nullptr) const;
  /// ServedPrefix's second pass, when some sliding window lacks a block among path[0, full).
  std::int32_t ServedBySlidingWindows(const std::vector<NodeId>& path, std::int32_t full) const;
  /// A partial match of the block after plan->full_blocks (at most key_len tokens of keys in
  /// all): the child sharing the longest token prefix with it, if every window can reuse it.
  /// Returns whether one was found (and recorded in *plan).
  bool MatchPartialBlock(const TokenId* tokens, std::int32_t key_len, const ReuseExtras& extras,
                         ReusePlan* plan) const;
  /// Links `seq`'s blocks for its first `key_len` tokens into the tree (full blocks only if
  /// `full_only`). With `pinned`, pins the tree's block of every stored position in every window
  /// and appends each pinned block to (*pinned)[window index]. Returns positions newly stored.
  std::int32_t StoreChain(const Sequence& seq, std::int32_t key_len, bool full_only,
                          std::vector<std::vector<BlockId>>* pinned);
  /// A node of a StoreChain walk: the chain's first `depth` positions end at `node` (the root:
  /// depth 0), whose chained hash is `hash`.
  struct ChainNode {
    std::int32_t depth = 0;
    NodeId node = ReuseTree::kRoot;
    std::uint64_t hash = 0;
  };
  /// What StoreChain did at one position: linked a block in some window, and whether the
  /// position is settled in every window.
  struct StoredPosition {
    bool any = false;
    bool settled = true;
  };
  class StoredEvents;  // the stored events of one walk (kv_cache_manager_reuse.cpp)
  /// The block `seq` stores at position `d` of window `w`, or kNullBlock.
  BlockId OwnBlock(const Sequence& seq, std::size_t w, std::int32_t d) const;
  /// Whether position `node` is settled in window `w` for a sequence whose block there is `b`.
  bool Settled(std::size_t w, NodeId node, BlockId b) const;
  /// Whether a store may resume where the last one found every position settled.
  bool StoreResumable() const;
  /// The key of position `d` of `seq` (`key_len` tokens keyed in all) below a parent with chained
  /// hash `parent_hash`: returns its hash and sets *len and *digest.
  std::uint64_t ChainKey(const Sequence& seq, std::int32_t key_len, std::int32_t d, std::uint64_t parent_hash,
                         std::int32_t* len, std::uint64_t* digest) const;
  /// `seq`'s record of position `d` in window `w`: its live block and that block's generation,
  /// or what it released there.
  std::pair<BlockId, std::uint32_t> ReleaseRecord(const Sequence& seq, std::size_t w, std::int32_t d) const;
  /// Where a store of `seq` (`key_len` tokens) starts: its resume point if still trusted, else
  /// the root.
  ChainNode ResumeStore(const Sequence& seq, std::int32_t key_len) const;
  /// Debug builds: every position a store skips from the root up to `start` is settled.
  void CheckStoreResume(const Sequence& seq, std::int32_t key_len, const ChainNode& start) const;
  /// StoreChain at node `here` (`len` tokens) below `parent`: links `seq`'s block of every
  /// window that the node lacks, queues their stored events and, with `pinned`, pins the node's
  /// blocks.
  StoredPosition StorePosition(const Sequence& seq, const ChainNode& here, std::int32_t len, const ChainNode& parent,
                               std::vector<std::vector<BlockId>>* pinned, StoredEvents* events);
  /// Records node `here` as `seq`'s resume point, guarded by its record in the first window that
  /// has not released the position.
  void MarkStoreResume(const Sequence& seq, const ChainNode& here) const;
  /// Pinned block lists per window index, keyed by window size.
  std::map<WindowSize, std::vector<BlockId>> PinnedByWindow(std::vector<std::vector<BlockId>> pinned) const;
  void Pin(std::size_t w, BlockId b);
  void Unpin(std::size_t w, BlockId b);

  // ---- Recurrent state (kv_cache_manager_state.cpp).
  /// Makes the state pools (after the tree, whose columns past the windows hold checkpoints).
  void MakeStatePools(const ManagerConfig& config, std::vector<StateGroupLayout> groups);
  /// PlanReuse's state step: the longest prefix of at most `served` blocks (which the windows
  /// serve) that the windows serve and every state group has a checkpoint at, with room to hold
  /// them for the restore; fills plan->restore.
  std::int32_t StateServed(const std::vector<NodeId>& path, std::int32_t served, ReusePlan* plan) const;
  /// Whether the sliding windows serve a prefix of `p` blocks of `path`.
  bool SlidingWindowsServe(const std::vector<NodeId>& path, std::int32_t p) const;
  /// Whether every state group can give `takes` more slots and still keep one for each of
  /// `sequences_after` fewer than max_batch_size sequences.
  bool StateSlack(std::int32_t takes, std::size_t sequences_after) const;
  /// Admission: working slots, the restore (or zeroing) copy and the checkpoint plan, then the
  /// first chunk's advance. Never fails (slots were checked).
  void AdmitState(Sequence& seq, const ReusePlan& plan, std::int32_t first_end);
  /// The one door of state progress: `seq` now has blocks for `to` tokens (was `from`), and the
  /// step that computes them ends its working state there: takes the checkpoints due at `to`.
  void AdvanceState(Sequence& seq, std::int32_t from, std::int32_t to);
  /// Takes a pending checkpoint of every group at `position` (all or none) and queues its copy.
  void TakeCheckpoint(Sequence& seq, std::int32_t position, bool rolling);
  /// Links `seq`'s ready checkpoints at or below `stored_tokens` into the tree (StoreChain has
  /// stored its blocks); `all`: frees every other pending one (the sequence ends).
  void StoreCheckpoints(Sequence& seq, std::int32_t stored_tokens, bool all);
  /// The end of `seq`: its working slots and pending checkpoints are freed, its queued copies dropped.
  void ReleaseState(Sequence& seq);
  /// A fork's child: its own working slots, copied from the parent's.
  void ForkState(const Sequence& parent, Sequence& child);
  /// The checkpoint plan of a prompt of `n` tokens that reuses `reused` tokens, matched
  /// `attention_blocks` blocks in the windows.
  void PlanCheckpoints(std::int32_t n, std::int32_t reused, std::int32_t attention_blocks,
                       std::vector<std::int32_t>* out) const;
  /// The chunk limit of a sequence at `from` tokens of a `prompt_len`-token prompt whose
  /// checkpoint plan is `plan`.
  std::int32_t ChunkLimitOf(const std::vector<std::int32_t>& plan, std::int32_t from, std::int32_t num_tokens,
                            std::int32_t prompt_len) const;
  void CheckStateInvariants() const;
  void DropQueuedCopies(SeqId id);
  /// Rewind on a model with recurrent layers: the index of the ready checkpoint of `seq` at
  /// `new_len` (-1 without state groups); throws std::invalid_argument when there is none.
  std::int32_t RewindCheckpoint(const Sequence& seq, std::int32_t new_len) const;
  /// Restores the working state from checkpoint `k` (RewindCheckpoint) and drops the later ones.
  void RewindState(Sequence& seq, std::int32_t k);
  /// An admission's lost-hit counters (why matched keys were not reused).
  void CountLostHits(const ReusePlan& plan);
  /// Copies slot `src` of state group `g` into `dst` (kNoSlot: zeroes `dst`) and waits.
  void CopySlot(std::size_t g, SlotId src, SlotId dst);
  /// The queued copies were made: their checkpoints are ready to be stored.
  void MarkCopiesDone();
  /// The tree node of `seq`'s first `depth` full blocks (`key_len` tokens keyed), or kNoNode.
  NodeId NodeAtDepth(const Sequence& seq, std::int32_t key_len, std::int32_t depth) const;

  // ---- Invariants (kv_cache_manager_invariants.cpp).
  /// Checks one sequence's lengths and block lists, counting its references into *refs.
  void CheckSequence(SeqId id, const Sequence& seq, std::vector<std::vector<std::int32_t>>* refs) const;
  /// Checks ownership state: release records mirror the blocks' releaser lists, and every cached
  /// block a sequence holds (or still owns by a valid release record) is the tree node of that
  /// sequence's own prefix at that position.
  void CheckOwnership() const;
  void CheckReleaseRecords(std::size_t w) const;
  void CheckCachedPrefixes(SeqId id, const Sequence& seq) const;

  std::int32_t tpb_;
  std::int32_t max_seq_len_;
  std::int32_t max_batch_size_;
  std::int32_t max_draft_tokens_;
  std::int32_t max_blocks_per_seq_;
  std::int32_t kv_factor_;
  std::vector<WindowSize> window_sizes_;
  /// Per window: its attention kind, the one owner of its rules (made by MakeAttentionKind).
  std::vector<std::unique_ptr<AttentionKind>> kinds_;
  std::unique_ptr<MemoryBackend> backend_;
  /// Slab lending (or none): declared before windows_, so its arena is freed after them.
  std::unique_ptr<SlabLender> lender_;
  std::vector<std::unique_ptr<WindowBlockManager>> windows_;
  std::atomic<bool> may_copy_{false};  ///< MayCopyBlocks() (set by ForkSequence too)
  bool forked_ = false;  ///< A fork happened: batch writes check that their blocks are private.
  std::vector<WindowCounters> counters_;
  std::vector<std::pair<std::int32_t, std::int32_t>> layer_to_pool_;
  std::vector<std::pair<std::size_t, std::size_t>> pool_index_;  // global pool -> (window, pool)
  std::unordered_map<SeqId, Sequence> sequences_;
  bool reuse_ = false;
  bool partial_reuse_ = true;
  bool copy_on_partial_ = true;
  SwaReusePolicy swa_policy_ = SwaReusePolicy::kPlaceholder;
  std::unique_ptr<EventLog> events_;
  std::unique_ptr<ReuseTree> tree_;
  std::vector<std::vector<std::int32_t>> pins_;  // per window, per block
  std::int64_t fake_now_ms_ = -1;
  std::uint64_t stamp_ = 0;
  // Scratch of the prompt checks (every caller holds mu_): kept so that an admission, or a
  // deferred one retried every step, allocates nothing for them.
  mutable ReusePlan plan_;
  mutable std::vector<std::int32_t> prompt_need_;
  mutable std::vector<std::int32_t> prompt_front_;
  /// Per window: a sequence of front_null * tokens_per_block + release_base_[w] tokens releases
  /// its front block (window + max_draft_tokens + tokens_per_block; unreachable for full
  /// attention).
  std::vector<std::int64_t> release_base_;
  /// Per window: the tokens it keeps behind a sequence's end (block_math::Keep).
  std::vector<std::int64_t> keep_;
  /// Per window: ceil(window / tokens_per_block), the blocks a window spans.
  std::vector<std::int32_t> window_blocks_;
  mutable std::vector<std::int64_t> step_total_;  // GetStepNeeds: per token position
  mutable std::vector<const Sequence*> step_seqs_;  // GetStepNeeds: the sequences, looked up once
  mutable std::vector<block_math::Registration> registration_;  // per window
  // Scratch space of the batch calls (AddTokens, Prefill, StoreContextBlocks), kept to avoid
  // allocations on the per-step path.
  std::vector<Sequence*> batch_;
  std::vector<char> batch_new_block_;  // per batch_ entry: its new token starts a block
  std::vector<std::int32_t> batch_write_;  // per batch_ entry: the position written in place, or -1
  std::vector<std::int32_t> batch_kept_;   // per batch_ entry: the tokens that block held before
  std::vector<BlockId> shared_release_;
  // Per window, the blocks check of AddSequence, Prefill and AddTokens (kept: no allocation
  // per call): blocks needed, blocks it can hand out, and (AddTokens) whether releases count.
  std::vector<std::int64_t> check_need_;  // (AddTokens, Prefill: filled before ShortWindowForBatch)
  std::vector<std::int64_t> admit_fresh_;  // Admit: per window, the free blocks each took
  std::vector<std::int64_t> check_available_;
  std::vector<char> batch_counted_;
  std::vector<SeqId> displaced_;  // filled by Grant, consumed by Attach
  // The shared tier (kv_cache_manager_shared.cpp): null without one.
  std::unique_ptr<SharedTier> shared_;
  std::int32_t shared_timeout_ms_ = 0;     // bound on one admission's lookups
  std::vector<std::int32_t> shared_label_;  // per window: its key label (the window, 0 for full attention)
  SharedFetch shared_fetch_;
  std::vector<unsigned char> shared_buffer_;  // a block's bytes on their way to the store
  // Recurrent state (kv_cache_manager_state.cpp): one pool per state group.
  std::vector<std::unique_ptr<StatePool>> states_;
  CheckpointPolicy checkpoint_policy_;
  struct QueuedCopy {
    StateCopy copy;
    SeqId seq = -1;
  };
  std::vector<QueuedCopy> queued_copies_;
  struct StateCounters {
    std::int64_t stored = 0;
    std::int64_t restored = 0;
    std::int64_t skipped = 0;
    std::int64_t onboarded = 0;
    std::int64_t lost_attention = 0;
    std::int64_t lost_sliding = 0;
    std::int64_t lost_checkpoint = 0;
  };
  StateCounters state_counters_;
  void* zeros_ptr_ = nullptr;  // zero-filled host memory of zeros_bytes_ (CopySlot's zeroing)
  std::size_t zeros_bytes_ = 0;
  mutable std::mutex mu_;
};

}  // namespace kvcache
