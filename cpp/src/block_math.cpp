#include "kvcache/block_math.h"

#include <algorithm>

namespace kvcache::block_math {

std::int32_t PeakLiveBlocks(std::int64_t lo, std::int64_t hi, std::int64_t keep, std::int32_t tokens_per_block,
                            std::int32_t front) {
  const std::int64_t tpb = tokens_per_block;
  // Below m_star the front released before is what counts; from m_star on, Released(m) > front.
  const std::int64_t m_star = Releases(keep) ? keep + (front + 1) * tpb : kKeepAll;
  std::int64_t best = 0;
  if (lo < m_star) best = CeilDiv(std::min(hi, m_star - 1), tpb) - front;
  if (hi >= m_star) {
    // For m = keep + j (j >= 1): ceil(m / tpb) - j / tpb = a + ceil((b + j % tpb) / tpb) with
    // keep = a * tpb + b; non-decreasing in j % tpb, so take the largest residue reached.
    const std::int64_t j0 = std::max(lo, m_star) - keep;
    const std::int64_t j1 = hi - keep;
    const std::int64_t s = (j1 - j0 + 1 >= tpb || j0 % tpb > j1 % tpb) ? tpb - 1 : j1 % tpb;
    best = std::max(best, keep / tpb + CeilDiv(keep % tpb + s, tpb));
  }
  return static_cast<std::int32_t>(best);
}

std::int32_t PrefillPeak(std::int64_t start, std::int64_t end, std::int64_t chunk, std::int64_t keep,
                         std::int32_t tokens_per_block, std::int32_t front) {
  // The worst chunk ending at b starts as early as it can: at `start` while b <= start + chunk,
  // else at b - chunk, which is PeakLiveBlocks with keep + chunk - 1 kept tokens.
  const std::int64_t first_end = std::min(end, start + chunk);
  std::int64_t best =
      CeilDiv(first_end, tokens_per_block) - std::max(front, Released(start + 1, keep, tokens_per_block));
  if (first_end < end) {
    const std::int64_t chunk_keep = Releases(keep) ? keep + chunk - 1 : kKeepAll;
    best = std::max<std::int64_t>(best, PeakLiveBlocks(first_end + 1, end, chunk_keep, tokens_per_block, front));
  }
  return static_cast<std::int32_t>(best);
}

std::int32_t FirstChunkBound(std::int64_t n, std::int64_t size, std::int64_t window, std::int64_t keep,
                             std::int32_t tokens_per_block) {
  if (!Releases(keep)) return static_cast<std::int32_t>(CeilDiv(n, tokens_per_block));
  // The positions up to R + size for a reused prefix R, less the (R - window) / tpb that a
  // sliding window skips: a sequence growing from size to n tokens keeping window + size.
  return PeakLiveBlocks(std::min(size, n), n, window + size, tokens_per_block);
}

std::int64_t PeakNew(std::int64_t n, std::int64_t size, std::int64_t final, const Registration* reg,
                     std::int64_t window, std::int64_t keep, std::int32_t tokens_per_block) {
  const std::int64_t tpb = tokens_per_block;
  if (!Releases(keep)) {
    if (reg == nullptr) return CeilDiv(final, tpb);
    return reg->cost + std::max<std::int64_t>(0, CeilDiv(final, tpb) - CeilDiv(reg->first_end, tpb));
  }
  std::int64_t start = 0;
  std::int32_t front = 0;
  bool later = size < n;
  std::int64_t peak = 0;
  if (reg == nullptr) {
    peak = FirstChunkBound(n, size, window, keep, tokens_per_block);
  } else {
    start = reg->reused;
    front = reg->front;
    later = reg->first_end < n;
    // Holding every position of the first chunk: what it takes plus the reused blocks that
    // running sequences hold (their release credits become shared).
    peak = std::max(reg->cost, CeilDiv(reg->first_end, tpb) - front);
  }
  if (later) peak = std::max<std::int64_t>(peak, PrefillPeak(start + 1, n, size, keep, tokens_per_block, front));
  if (final > n) peak = std::max<std::int64_t>(peak, PeakLiveBlocks(n + 1, final, keep, tokens_per_block, front));
  return peak;
}

std::int64_t BlocksToRunAlone(std::int64_t n, std::int64_t final, std::int64_t chunk, std::int64_t window,
                              std::int64_t keep, std::int32_t tokens_per_block) {
  const std::int64_t size = chunk <= 0 ? n : std::min(chunk, n);
  const Registration alone{0, size, 0, CeilDiv(size, tokens_per_block)};
  return PeakNew(n, size, std::max(final, n), &alone, window, keep, tokens_per_block);
}

std::int64_t RemainingBlocks(std::int64_t num_tokens, std::int64_t context_len, std::int64_t final,
                             std::int64_t chunk, std::int32_t front, std::int64_t keep, std::int32_t tokens_per_block) {
  const std::int64_t live = CeilDiv(num_tokens, tokens_per_block) - front;
  std::int64_t peak = 0;
  if (num_tokens < context_len) {
    const std::int64_t rest = context_len - num_tokens;
    const std::int64_t size = chunk <= 0 ? rest : std::min(chunk, rest);
    peak = PrefillPeak(num_tokens, context_len, size, keep, tokens_per_block, front);
    if (final > context_len) {
      peak = std::max<std::int64_t>(peak, PeakLiveBlocks(context_len + 1, final, keep, tokens_per_block, front));
    }
  } else {
    if (final <= num_tokens) return 0;
    peak = PeakLiveBlocks(num_tokens + 1, final, keep, tokens_per_block, front);
  }
  return std::max<std::int64_t>(0, peak - live);
}

std::int64_t DemandBlocks(std::int64_t n, std::int64_t seq_len, std::int64_t keep, std::int64_t budget,
                          std::int32_t tokens_per_block) {
  const std::int64_t tpb = tokens_per_block;
  const std::int64_t whole = n * CeilDiv(seq_len, tpb);
  if (!Releases(keep)) return whole;
  return std::min((n * (keep + 2 * tpb - 2) + budget) / tpb, whole);
}

std::int64_t ForkedBeamBlocks(std::int64_t fork_len, std::int64_t final, std::int64_t keep,
                              std::int32_t tokens_per_block) {
  if (final <= fork_len) return 0;
  const std::int64_t own = CeilDiv(final, tokens_per_block) - fork_len / tokens_per_block;
  return std::min<std::int64_t>(own, PeakLiveBlocks(fork_len + 1, final, keep, tokens_per_block));
}

}  // namespace kvcache::block_math
