// A KV tier shared by managers on several machines: blocks in a Redis server, keyed by content.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace kvcache {

/// Where the store listens and who the manager is to it: `redis://[[user]:password@]host[:port][/db]`
/// (port 6379 and db 0 by default; no user: Redis's `default` user).
struct RedisAddress {
  std::string host;
  int port = 6379;
  int db = 0;
  std::string user;      ///< Empty: AUTH with the password alone (the default user).
  std::string password;  ///< Empty: no AUTH.
};

/// The environment variable that holds the store's password when the URL names none, so that
/// it need not be written in config files.
inline constexpr const char* kSharedCachePasswordEnv = "KVCACHE_SHARED_CACHE_PASSWORD";

/// Parses a `redis://[[user]:password@]host[:port][/db]` URL (user and password percent-decoded);
/// throws std::invalid_argument naming what is wrong: another scheme (`rediss://` TLS is not
/// spoken), a control character, a bad port or database, no host.
RedisAddress ParseRedisUrl(const std::string& url);
/// ParseRedisUrl, with the password from `password_env` (when set and non-empty) if the URL has
/// none.
RedisAddress ResolveRedisUrl(const std::string& url, const char* password_env = kSharedCachePasswordEnv);

/// One RESP reply: a status (`+`), an error (`-`), an integer (`:`) or a bulk string (`$`).
struct RespReply {
  char type = 0;
  bool nil = false;  ///< A null bulk string (GET of a missing key).
  std::int64_t integer = 0;
  std::string text;  ///< The status, the error message or the bulk string's bytes.
};

/// A RESP client over one TCP connection: every call sends its commands at once (pipelined) and
/// reads one reply per command, never waiting past its deadline (non-blocking socket, poll()).
/// Any failure (refused, reset, a protocol error, the deadline) closes the connection; the next
/// call connects again, but not before a backoff (50 ms doubling to 2 s, reset by a success)
/// during which calls fail at once; a call that ran out of time on a live connection closes
/// it without a backoff. With a password, every connection first sends `AUTH [user] password`;
/// a refusal is a failure like the others, also counted in auth_failures(). Not thread-safe
/// (auth_failures() may be read from any thread).
class RespConnection {
 public:
  explicit RespConnection(RedisAddress address) : address_(std::move(address)) {}
  ~RespConnection() { Close(); }
  RespConnection(const RespConnection&) = delete;
  RespConnection& operator=(const RespConnection&) = delete;

  /// Appends one command (its arguments as RESP bulk strings) to `wire`.
  static void Append(std::string* wire, const std::vector<std::pair<const void*, std::size_t>>& args);
  /// Sends `wire` (`count` commands) and reads `count` replies into *replies; false on any
  /// failure or at `deadline_ms` (steady-clock milliseconds; the replies are then incomplete).
  bool Call(const std::string& wire, std::size_t count, std::vector<RespReply>* replies, std::int64_t deadline_ms);
  /// Now on the clock that deadlines use.
  static std::int64_t NowMs();
  /// Connections the store refused to authenticate (wrong password or user, AUTH to a store
  /// that has no password, or a password missing).
  std::int64_t auth_failures() const { return auth_failures_.load(); }

 private:
  /// After connecting: AUTH, then SELECT; false when the store refuses either.
  bool Handshake(std::int64_t deadline_ms);
  bool Connect(std::int64_t deadline_ms);
  bool Send(const std::string& wire, std::int64_t deadline_ms);
  bool Receive(std::size_t count, std::vector<RespReply>* replies, std::int64_t deadline_ms);
  bool Fail();
  void Close();

  RedisAddress address_;
  int fd_ = -1;
  std::int64_t retry_at_ms_ = 0;
  int backoff_ms_ = 0;
  std::string in_;  ///< Bytes received and not parsed yet.
  std::atomic<std::int64_t> auth_failures_{0};
};

/// Counters of a shared tier (read while it runs).
struct SharedTierCounters {
  std::int64_t hits = 0;         ///< Blocks onboarded from the store.
  std::int64_t writes = 0;       ///< Blocks the store accepted.
  std::int64_t write_drops = 0;  ///< Blocks not written: the write queue was full.
  std::int64_t errors = 0;       ///< Lookups or write batches that failed, and values refused.
  std::int64_t auth_failures = 0;  ///< Connections the store refused to authenticate.
};

/// The store as the manager sees it: pipelined lookups on the caller's thread (under the
/// manager's lock, each bounded by the caller's deadline) and writes by a background thread
/// from a queue bounded by `queue_bytes` (a write that does not fit is dropped and counted).
class SharedTier {
 public:
  SharedTier(RedisAddress address, std::string ns, std::size_t queue_bytes);
  ~SharedTier();
  SharedTier(const SharedTier&) = delete;
  SharedTier& operator=(const SharedTier&) = delete;

  const std::string& ns() const { return ns_; }
  /// The key of window label `label` (the sliding window, or 0 for full attention) and hash.
  std::string Key(std::int32_t label, std::uint64_t hash) const;
  /// found[i] = 1 when keys[i] exists; false (an error counted) when the store cannot answer
  /// by `deadline_ms` (RespConnection::NowMs's clock).
  bool Exists(const std::vector<std::string>& keys, std::vector<char>* found, std::int64_t deadline_ms);
  /// values[i] = the bytes of keys[i], empty when missing; false (an error counted) on failure,
  /// when the values of the replies that arrived before it are still filled in. A value that
  /// can be no block (empty, or an error reply such as a key of another Redis type) is a miss
  /// and counts as an error. Sends `batch`
  /// GETs at a time: Redis answers a pipeline once it has run all of it, so smaller batches let
  /// a lookup cut short by its deadline keep what came back.
  bool Fetch(const std::vector<std::string>& keys, std::vector<std::string>* values, std::int64_t deadline_ms,
             std::size_t batch);
  /// Reserves `bytes` of the write queue for one Push; false (a drop counted) when they would
  /// take it past its bound (one write always fits an empty queue).
  bool Reserve(std::size_t bytes);
  /// Queues SET key value, whose key.size() + value.size() bytes Reserve reserved.
  void Push(std::string key, std::string value);
  /// Waits until every queued write was sent and answered, up to `timeout_ms`; true if so.
  bool Flush(int timeout_ms);
  void CountHits(std::int64_t n) { hits_ += n; }
  void CountError() { ++errors_; }
  SharedTierCounters Counters() const;

 private:
  void WriterLoop();

  std::string ns_;
  std::size_t queue_bytes_;
  RespConnection lookup_;
  RespConnection writer_conn_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::string, std::string>> queue_;
  std::size_t queued_bytes_ = 0;  ///< Queued plus in flight.
  bool busy_ = false;             ///< The writer holds a batch.
  bool stop_ = false;
  std::atomic<std::int64_t> hits_{0};
  std::atomic<std::int64_t> writes_{0};
  std::atomic<std::int64_t> write_drops_{0};
  std::atomic<std::int64_t> errors_{0};
  std::thread writer_;
};

/// Bytes of the header that precedes a block's bytes in the store: magic, a digest of the
/// block's whole key (namespace, window label and chained hash), the byte count and a
/// checksum of the bytes seeded with the key's digest. A value copied under another key (another
/// window, another namespace) does not verify there.
inline constexpr std::size_t kSharedBlockHeader = 32;

/// A stored value for `key`: the header, then `bytes` bytes from `data`.
std::string EncodeSharedBlock(const std::string& key, const unsigned char* data, std::size_t bytes);
/// The bytes of `value` if it is an intact block written under `key` with `bytes` bytes, else null.
const unsigned char* DecodeSharedBlock(const std::string& value, const std::string& key, std::size_t bytes);

}  // namespace kvcache
