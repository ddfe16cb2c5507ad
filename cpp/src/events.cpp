#include "kvcache/events.h"

#include <chrono>
#include <utility>

namespace kvcache {

void EventLog::PushLocked(KVCacheEvent event) {
  event.event_id = next_id_++;
  events_.push_back(std::move(event));
  while (events_.size() > max_size_) events_.pop_front();
}

void EventLog::Push(KVCacheEvent event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    PushLocked(std::move(event));
  }
  cv_.notify_all();
}

void EventLog::PushRemoved(WindowSize window, std::uint64_t hash, std::int32_t state_group) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!events_.empty() && events_.back().kind == EventKind::kRemoved && events_.back().window_size == window &&
        events_.back().state_group == state_group) {
      events_.back().hashes.push_back(hash);
    } else {
      KVCacheEvent e;
      e.kind = EventKind::kRemoved;
      e.window_size = window;
      e.state_group = state_group;
      e.hashes.push_back(hash);
      PushLocked(std::move(e));
    }
  }
  cv_.notify_all();
}

std::vector<KVCacheEvent> EventLog::Take(std::int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (events_.empty() && timeout_ms > 0) WaitLocked(lock, timeout_ms);
  std::vector<KVCacheEvent> out(std::make_move_iterator(events_.begin()),
                                std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

void EventLog::WaitLocked(std::unique_lock<std::mutex>& lock, std::int64_t timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto has_event = [this] { return !events_.empty(); };
  const Clock::time_point now = Clock::now();
  // wait_for(timeout) computes now + timeout in the clock's nanoseconds; for a timeout near
  // INT64_MAX milliseconds that overflows into a deadline in the past, and the wait returns at
  // once. A deadline past what the clock can represent means: wait until an event arrives.
  const auto max_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  if (timeout_ms >= max_ms.count()) {
    cv_.wait(lock, has_event);
  } else {
    cv_.wait_until(lock, now + std::chrono::milliseconds(timeout_ms), has_event);
  }
}

}  // namespace kvcache
