#include "kvcache/attention_kind.h"

#include <algorithm>
#include <limits>

#include "kvcache/block_math.h"

namespace kvcache {

const char* GroupKindName(GroupKindId id) {
  switch (id) {
    case GroupKindId::kFullAttention:
      return "full_attention";
    case GroupKindId::kSlidingWindow:
      return "sliding_window";
    case GroupKindId::kRecurrentState:
      return "recurrent_state";
  }
  return "unknown";
}

std::int64_t FullAttention::Keep(std::int64_t, std::int64_t) const { return block_math::kKeepAll; }

std::int64_t FullAttention::ReleaseBase(std::int32_t, std::int64_t) const {
  return std::numeric_limits<std::int64_t>::max() / 2;  // no sequence length reaches it
}

std::int64_t SlidingWindow::Keep(std::int64_t max_draft_tokens, std::int64_t max_seq_len) const {
  return block_math::Keep(window(), max_draft_tokens, max_seq_len);
}

std::int64_t SlidingWindow::ReleaseBase(std::int32_t tokens_per_block, std::int64_t max_draft_tokens) const {
  return static_cast<std::int64_t>(window()) + max_draft_tokens + tokens_per_block;
}

std::int32_t SlidingWindow::FirstNeededBlock(std::int32_t blocks, std::int32_t tokens_per_block) const {
  return std::max(0, blocks * tokens_per_block - window()) / tokens_per_block;
}

std::unique_ptr<AttentionKind> MakeAttentionKind(WindowSize window, WindowSize max_seq_len) {
  const WindowSize w = EffectiveWindow(window, max_seq_len);
  if (w == max_seq_len) return std::make_unique<FullAttention>(max_seq_len);
  return std::make_unique<SlidingWindow>(w);
}

}  // namespace kvcache
