// The kinds of cache group a model's layers fall into, one type each, each owning its rules:
// which tokens a sequence may drop as it grows, which cached positions a prefix hit needs, and
// how its keys are labelled. The façade asks these types and never re-derives the rules.
#pragma once

#include <cstdint>
#include <memory>

#include "kvcache/types.h"

namespace kvcache {

/// What a group of layers keeps per sequence.
enum class GroupKindId : std::uint8_t {
  kFullAttention,   ///< K/V of every token.
  kSlidingWindow,   ///< K/V of the last `window` tokens.
  kRecurrentState,  ///< One fixed-size state (conv window, SSM / delta-rule state), updated in place.
};

/// The name of a kind as events and stats spell it: "full_attention", "sliding_window",
/// "recurrent_state".
const char* GroupKindName(GroupKindId id);

/// The rules of an attention kind (a group whose cache is per-token K/V in blocks).
///
/// A new kind (e.g. chunked local attention) is one more subclass and one more case in
/// MakeAttentionKind: the façade, the estimates and the hit search only call these methods.
class AttentionKind {
 public:
  virtual ~AttentionKind() = default;
  virtual GroupKindId id() const = 0;
  const char* name() const { return GroupKindName(id()); }
  /// Tokens of attention span (max_seq_len for full attention).
  WindowSize window() const { return window_; }
  /// True when a growing sequence drops blocks behind it (out of window).
  virtual bool ReleasesBlocks() const = 0;
  /// Tokens kept behind a sequence's end (block_math::Keep; kKeepAll when nothing is dropped).
  virtual std::int64_t Keep(std::int64_t max_draft_tokens, std::int64_t max_seq_len) const = 0;
  /// A sequence of front_null * tokens_per_block + ReleaseBase() tokens drops its front block
  /// (unreachable when nothing is dropped).
  virtual std::int64_t ReleaseBase(std::int32_t tokens_per_block, std::int64_t max_draft_tokens) const = 0;
  /// The first block position that a prefix hit of `blocks` whole blocks needs cached in this
  /// group (0: every block before it).
  virtual std::int32_t FirstNeededBlock(std::int32_t blocks, std::int32_t tokens_per_block) const = 0;
  /// Label of this group in shared-tier keys (0 for full attention, else the window).
  virtual std::int32_t KeyLabel() const = 0;
  /// Whether evicting a cached block drops the tree below it in this group (under
  /// SwaReusePolicy::kInvalidate a sliding window does too).
  virtual bool CascadesOnEvict(bool invalidate_policy) const = 0;

 protected:
  explicit AttentionKind(WindowSize window) : window_(window) {}

 private:
  WindowSize window_;
};

/// Every token attends every earlier token: a hit needs every block before it.
class FullAttention final : public AttentionKind {
 public:
  explicit FullAttention(WindowSize max_seq_len) : AttentionKind(max_seq_len) {}
  GroupKindId id() const override { return GroupKindId::kFullAttention; }
  bool ReleasesBlocks() const override { return false; }
  std::int64_t Keep(std::int64_t max_draft_tokens, std::int64_t max_seq_len) const override;
  std::int64_t ReleaseBase(std::int32_t tokens_per_block, std::int64_t max_draft_tokens) const override;
  std::int32_t FirstNeededBlock(std::int32_t, std::int32_t) const override { return 0; }
  std::int32_t KeyLabel() const override { return 0; }
  bool CascadesOnEvict(bool) const override { return true; }
};

/// A token attends the `window` tokens before it: blocks wholly behind that are dropped, and a
/// hit needs only the blocks covering its last `window` tokens.
class SlidingWindow final : public AttentionKind {
 public:
  explicit SlidingWindow(WindowSize window) : AttentionKind(window) {}
  GroupKindId id() const override { return GroupKindId::kSlidingWindow; }
  bool ReleasesBlocks() const override { return true; }
  std::int64_t Keep(std::int64_t max_draft_tokens, std::int64_t max_seq_len) const override;
  std::int64_t ReleaseBase(std::int32_t tokens_per_block, std::int64_t max_draft_tokens) const override;
  std::int32_t FirstNeededBlock(std::int32_t blocks, std::int32_t tokens_per_block) const override;
  std::int32_t KeyLabel() const override { return window(); }
  bool CascadesOnEvict(bool invalidate_policy) const override { return invalidate_policy; }
};

/// The one factory of attention kinds: a window of at least `max_seq_len` tokens (or <= 0) is
/// full attention, any other a sliding window.
std::unique_ptr<AttentionKind> MakeAttentionKind(WindowSize window, WindowSize max_seq_len);

/// The window a layer's configured window stands for: max_seq_len for full attention (<= 0 or
/// >= max_seq_len), else the window itself.
inline WindowSize EffectiveWindow(std::int32_t window, WindowSize max_seq_len) {
  return (window <= 0 || window >= max_seq_len) ? max_seq_len : window;
}

}  // namespace kvcache
