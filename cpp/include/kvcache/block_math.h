// Block arithmetic of one sequence in one window: what a window releases as a sequence grows,
// and the most blocks a sequence holds over a decode stretch, a prefill in chunks, or a whole
// life. Pure functions: the manager's release rule, its estimates, the Python scheduler and
// the sizing planner all compute block counts here and nowhere else.
#pragma once

#include <cstdint>
#include <limits>

namespace kvcache::block_math {

/// `keep` of a window that never releases (full attention): no sequence length reaches it.
inline constexpr std::int64_t kKeepAll = std::numeric_limits<std::int64_t>::max() / 4;

/// ceil(a / b) for a >= 0 and b > 0.
constexpr std::int64_t CeilDiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

/// Tokens a window keeps behind a sequence's end: the window plus the draft tokens a step may
/// rewind (`max_draft_tokens`), or kKeepAll when that reaches `max_seq_len` (the window then
/// never releases a block).
constexpr std::int64_t Keep(std::int64_t window, std::int64_t max_draft_tokens, std::int64_t max_seq_len) {
  return window + max_draft_tokens < max_seq_len ? window + max_draft_tokens : kKeepAll;
}

/// True when a window keeping `keep` tokens can release blocks.
constexpr bool Releases(std::int64_t keep) { return keep < kKeepAll; }

/// Leading block positions a window has released once a sequence reached `num_tokens` tokens:
/// every block whose positions all lie below `num_tokens - keep`, i.e.
/// `max(0, num_tokens - keep) / tokens_per_block`.
constexpr std::int32_t Released(std::int64_t num_tokens, std::int64_t keep, std::int32_t tokens_per_block) {
  return num_tokens > keep ? static_cast<std::int32_t>((num_tokens - keep) / tokens_per_block) : 0;
}

/// Most blocks one sequence holds in a window while it grows token by token from `lo` to `hi`
/// tokens (lo <= hi): after token m it holds `ceil(m / tpb) - max(front, Released(m))`, `front`
/// being the blocks released (or never given) before. O(1).
std::int32_t PeakLiveBlocks(std::int64_t lo, std::int64_t hi, std::int64_t keep, std::int32_t tokens_per_block,
                            std::int32_t front = 0);

/// Most blocks one sequence holds in a window after any prefill chunk of at most `chunk` tokens
/// that starts at `start` tokens or later and ends by `end` tokens. A chunk from a to b tokens
/// first releases what a sequence of a + 1 tokens releases, then holds the blocks up to b. The
/// exact worst case over every way of cutting [start, end) into such chunks.
std::int32_t PrefillPeak(std::int64_t start, std::int64_t end, std::int64_t chunk, std::int64_t keep,
                         std::int32_t tokens_per_block, std::int32_t front);

/// Most blocks a first chunk of `size` tokens (after any reused prefix) gives an `n`-token
/// prompt in a window of `window` tokens, over every reused prefix: the bound charged when
/// what the cache will hold at registration is unknown.
std::int32_t FirstChunkBound(std::int64_t n, std::int64_t size, std::int64_t window, std::int64_t keep,
                             std::int32_t tokens_per_block);

/// A sequence's registration as far as its block counts go: `reused` prompt tokens found in the
/// cache, blocks up to `first_end` tokens after it, `front` leading positions left without a
/// block, and `cost` free blocks taken.
struct Registration {
  std::int64_t reused = 0;
  std::int64_t first_end = 0;
  std::int32_t front = 0;
  std::int64_t cost = 0;
};

/// Most free blocks a sequence not registered yet takes from a window until it holds `final`
/// tokens (final >= n), its `n`-token prompt prefilled in chunks of at most `size` tokens:
/// `reg` is its registration now, or null for the bound over every reused prefix.
std::int64_t PeakNew(std::int64_t n, std::int64_t size, std::int64_t final, const Registration* reg,
                     std::int64_t window, std::int64_t keep, std::int32_t tokens_per_block);

/// Most blocks one more beam forked from a sequence of `fork_len` tokens takes while it grows to
/// `final` tokens (0 when final <= fork_len): a copy of the shared partial last block and the
/// blocks its own tokens start. Its own blocks are at most the blocks it holds (a sliding
/// window: PeakLiveBlocks), and the full blocks before the fork stay shared (never counted
/// twice): min(PeakLiveBlocks(fork_len + 1, final), ceil(final / tpb) - floor(fork_len / tpb)).
std::int64_t ForkedBeamBlocks(std::int64_t fork_len, std::int64_t final, std::int64_t keep,
                              std::int32_t tokens_per_block);

/// Most blocks one sequence holds in a window from registration to `final` tokens, with
/// nothing reused and its `n`-token prompt prefilled in chunks of at most `chunk` tokens
/// (chunk <= 0: whole): what it needs from an otherwise empty pool.
std::int64_t BlocksToRunAlone(std::int64_t n, std::int64_t final, std::int64_t chunk, std::int64_t window,
                              std::int64_t keep, std::int32_t tokens_per_block);

/// Free blocks a registered sequence may still take from a window before it holds `final`
/// tokens: it has blocks for `num_tokens` tokens of a `context_len`-token context, `front`
/// leading positions released; the rest of the context comes in chunks of at most `chunk`
/// tokens (<= 0: one chunk).
std::int64_t RemainingBlocks(std::int64_t num_tokens, std::int64_t context_len, std::int64_t final,
                             std::int64_t chunk, std::int32_t front, std::int64_t keep, std::int32_t tokens_per_block);

/// Blocks of one window that `n` sequences of `seq_len` tokens hold at most together while they
/// run under chunked prefill with `budget` tokens per step (the demand the "auto" share policy
/// sizes for): a decoding sequence holds at most ceil((keep - 1) / tpb) + 1 blocks, one in
/// prefill its chunk on top, and a step's chunks add up to `budget` tokens, so together below
/// (n * (keep + 2 * tpb - 2) + budget) / tpb; never more than n * ceil(seq_len / tpb), which is
/// the demand of a window that never releases.
std::int64_t DemandBlocks(std::int64_t n, std::int64_t seq_len, std::int64_t keep, std::int64_t budget,
                          std::int32_t tokens_per_block);

}  // namespace kvcache::block_math
