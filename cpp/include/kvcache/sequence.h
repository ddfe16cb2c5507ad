// Per-sequence state: tokens and, per window, the positional block list.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kvcache/block_key.h"
#include "kvcache/prepared_prompt.h"
#include "kvcache/reuse_tree.h"
#include "kvcache/types.h"

namespace kvcache {

/// Blocks of one sequence in one window. Entry i holds tokens [i*tpb, (i+1)*tpb). The first
/// `front_null` entries are kNullBlock (released by the sliding window, or never needed);
/// every later entry is a referenced primary block of that window.
struct SequenceWindow {
  std::vector<BlockId> blocks;
  std::int32_t front_null = 0;
  /// For each of the first `front_null` positions: the block released there and its generation
  /// at release (kNullBlock when the position never held a block). A released block still holds
  /// this sequence's KV while its generation is unchanged.
  std::vector<std::pair<BlockId, std::uint32_t>> released;
};

/// A checkpoint a live sequence writes into `slot` of one state group: the state after its first
/// `position` tokens. `ready` once the engine took the copy that writes it (TakeStateCopies);
/// `rolling`: the finish policy's slot, moved to each block boundary the sequence decodes past.
struct PendingCheckpoint {
  std::int32_t position = 0;
  std::int32_t slot = -1;
  bool ready = false;
  bool rolling = false;
};

/// A sequence's slots in one state group: its working state and the checkpoints it writes.
struct SequenceState {
  std::int32_t working = -1;
  std::vector<PendingCheckpoint> pending;
};

/// Retention priority of the prompt tokens [start, end) (end < 0: to the end of the prompt).
struct PriorityRange {
  std::int32_t start = 0;
  std::int32_t end = -1;
  int priority = kDefaultPriority;
  std::int64_t duration_ms = 0;  ///< 0: does not expire.
};

/// One registered sequence (a request in flight).
struct Sequence {
  SeqId id = 0;
  std::int32_t num_tokens = 0;  ///< Tokens that have blocks (< prompt_len during chunked prefill).
  std::int32_t prompt_len = 0;
  /// True while prompt tokens remain without blocks (chunked prefill).
  bool InPrefill() const { return num_tokens < prompt_len; }
  int priority = kDefaultPriority;
  /// A prepared prompt admitted as such, shared with its PreparedPrompt (nothing copied): its
  /// tokens, and the extras digest and chained hash of each full block, so storing hashes
  /// nothing. Valid for block d while (d + 1) * tpb <= prompt_len. Null for a raw prompt.
  std::shared_ptr<const PreparedPrompt> prompt;
  /// The whole prompt, then generated tokens (keys for reuse). Empty while the tokens are
  /// exactly `prompt->tokens` (a prepared prompt before its first generated token or rewind):
  /// read them through TokenData() and TokenCount(), append through AppendToken().
  std::vector<TokenId> tokens;
  const TokenId* TokenData() const { return tokens.empty() ? prompt->tokens.data() : tokens.data(); }
  /// max(prompt_len, num_tokens).
  std::size_t TokenCount() const { return tokens.empty() ? prompt->tokens.size() : tokens.size(); }
  /// Full prompt blocks keyed by the prepared prompt (0 for a raw prompt).
  std::size_t NumKeyedBlocks() const { return prompt ? prompt->hashes.size() : 0; }
  /// Copies the shared prompt's tokens into `tokens` (room for as many again) before they change.
  void OwnTokens() {
    if (!tokens.empty()) return;
    tokens.reserve(2 * prompt->tokens.size());
    tokens.assign(prompt->tokens.begin(), prompt->tokens.end());
  }
  void AppendToken(TokenId t) {
    OwnTokens();
    tokens.push_back(t);
  }
  std::vector<SequenceWindow> windows;  ///< One per window, ascending window order.
  std::vector<SequenceState> states;    ///< One per recurrent state group (none without).
  /// Prompt positions (multiples of tokens_per_block, ascending) where a checkpoint is still to
  /// be taken: a prefill chunk ending there takes it, one straddling it skips it.
  std::vector<std::int32_t> checkpoint_plan;
  std::uint64_t batch_stamp = 0;        ///< Duplicate detection inside one batch call.
  bool explicit_priority = false;       ///< Priority or ranges given: applied to reused blocks.
  std::vector<PriorityRange> priority_ranges;
  std::optional<int> decode_priority;
  std::int64_t decode_duration_ms = 0;
  ReuseExtras extras;
  bool valid_for_reuse = true;  ///< False once another sequence reclaimed a released block.
  /// Where the next StoreChain walk of this sequence may start instead of the root: every
  /// position before `depth` was *settled* after the last walk (nothing to store there, now or
  /// later, see KVCacheManager::StoreChain) and `node` (chained hash `hash`) is the tree node of
  /// position depth - 1. `guard_window` (-1: none) is a window that held a live block at that
  /// position, `guard_block` / `guard_generation` that block and its generation: a rewind below
  /// depth * tokens_per_block changes them (the block is copied or handed out again), and a
  /// position every window had released cannot be rewound. StoreChain checks all of it before
  /// trusting it and walks from the root otherwise. Written by StoreChain only (a cache, hence
  /// mutable).
  struct StoreResume {
    std::int32_t depth = 0;
    NodeId node = kNoNode;
    std::uint64_t hash = 0;
    std::int32_t guard_window = -1;
    BlockId guard_block = kNullBlock;
    std::uint32_t guard_generation = 0;
  };
  mutable StoreResume store_resume;
  std::int32_t reused_tokens = 0;
  /// Most tokens the sequence will hold (prompt + max_new_tokens - 1), for the estimates of a
  /// scheduler; 0: unknown (max_seq_len is assumed).
  std::int32_t final_tokens = 0;
  std::int64_t reused_blocks = 0;
  std::int64_t missed_blocks = 0;
  std::int64_t new_blocks = 0;
};

}  // namespace kvcache
