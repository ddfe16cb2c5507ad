// Per-sequence state: tokens and, per window, the positional block list.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/types.h"

namespace kvcache {

/// Blocks of one sequence in one window. Entry i holds tokens [i*tpb, (i+1)*tpb). The first
/// `front_null` entries are kNullBlock (released by the sliding window, or never needed);
/// every later entry is a referenced primary block of that window.
struct SequenceWindow {
  std::vector<BlockId> blocks;
  std::int32_t front_null = 0;
};

/// One registered sequence (a request in flight).
struct Sequence {
  SeqId id = 0;
  std::int32_t num_tokens = 0;
  std::int32_t prompt_len = 0;
  int priority = kDefaultPriority;
  std::vector<TokenId> tokens;          ///< Prompt then generated tokens (keys for reuse).
  std::vector<SequenceWindow> windows;  ///< One per window, ascending window order.
  std::uint64_t batch_stamp = 0;        ///< Duplicate detection inside one batch call.
};

}  // namespace kvcache
