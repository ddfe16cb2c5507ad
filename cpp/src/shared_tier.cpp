#include "kvcache/shared_tier.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kvcache/block_key.h"
#include "kvcache/errors.h"

namespace kvcache {
namespace {

// "CKVCKS02" read as a little-endian word: values of the first format (bound to the chained hash
// only) do not verify and are rewritten by the next store.
constexpr std::uint64_t kMagic = 0x3230534b43564b43ULL;
constexpr std::uint64_t kChecksumSeed = 0x51ed27099b4a7c15ULL;
constexpr std::uint64_t kKeySeed = 0x6a09e667f3bcc909ULL;
constexpr int kFirstBackoffMs = 50;
constexpr int kMaxBackoffMs = 2000;
constexpr int kWriteTimeoutMs = 2000;  // a write batch is behind the calls: a longer bound
constexpr std::size_t kReadChunk = 1 << 16;

std::int64_t NowMs() { return RespConnection::NowMs(); }

int Remaining(std::int64_t deadline_ms) { return static_cast<int>(std::max<std::int64_t>(0, deadline_ms - NowMs())); }

/// Waits for `events` on `fd` until the deadline; false on a timeout or an error.
bool Wait(int fd, short events, std::int64_t deadline_ms) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int left = Remaining(deadline_ms);
    const int r = poll(&p, 1, left);
    if (r > 0) return (p.revents & (events | POLLHUP | POLLERR)) != 0;
    if (r == 0 || errno != EINTR) return false;
  }
}

/// Parses one reply at *pos of `in`: 1 parsed (advances *pos), 0 incomplete, -1 malformed.
int ParseReply(const std::string& in, std::size_t* pos, RespReply* out) {
  const std::size_t eol = in.find("\r\n", *pos);
  if (eol == std::string::npos) return 0;
  if (eol == *pos) return -1;
  const char type = in[*pos];
  const std::string line = in.substr(*pos + 1, eol - *pos - 1);
  out->type = type;
  out->nil = false;
  out->text.clear();
  if (type == '+' || type == '-') {
    out->text = line;
    *pos = eol + 2;
    return 1;
  }
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(line.c_str(), &end, 10);
  if (errno != 0 || end == line.c_str() || *end != '\0') return -1;
  if (type == ':') {
    out->integer = value;
    *pos = eol + 2;
    return 1;
  }
  if (type != '$') return -1;  // arrays and the rest: no command here answers with them
  if (value < 0) {
    out->nil = true;
    *pos = eol + 2;
    return 1;
  }
  const auto len = static_cast<std::size_t>(value);
  if (in.size() < eol + 2 + len + 2) return 0;
  out->text.assign(in, eol + 2, len);
  *pos = eol + 2 + len + 2;
  return 1;
}

std::uint64_t Checksum(std::uint64_t key_digest, const unsigned char* data, std::size_t bytes) {
  return HashBytes(kChecksumSeed ^ key_digest, data, bytes);
}

/// A block's whole key (namespace, window label, chained hash) as one word.
std::uint64_t KeyDigest(const std::string& key) { return HashBytes(kKeySeed, key.data(), key.size()); }

}  // namespace

std::int64_t RespConnection::NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

RedisAddress ParseRedisUrl(const std::string& url) {
  const std::string scheme = "redis://";
  for (const char c : url) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      ThrowInvalid("shared_cache_url must not hold control characters (a NUL, a newline, ...)");
    }
  }
  if (url.compare(0, 9, "rediss://") == 0) {
    ThrowInvalid("shared_cache_url '", url,
                 "': TLS (rediss://) is not spoken by the manager's client; reach the store through a local TLS "
                 "tunnel (stunnel, spiped) and give its redis:// address");
  }
  if (url.compare(0, scheme.size(), scheme) != 0) {
    ThrowInvalid("shared_cache_url must look like redis://[[user]:password@]host[:port][/db], got '", url, "'");
  }
  RedisAddress a;
  std::string rest = url.substr(scheme.size());
  const std::size_t at = rest.rfind('@');
  if (at != std::string::npos) {
    // Userinfo: [user]:password, or a password alone; percent-encoded ('@' as %40, ':' as %3A).
    const std::string info = rest.substr(0, at);
    rest.erase(0, at + 1);
    auto decode = [&](const std::string& text) {
      std::string out;
      for (std::size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '%') {
          out += text[i];
          continue;
        }
        const auto hex = [](char c) {
          return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        };
        const bool whole = i + 2 < text.size();
        const int hi = whole ? hex(text[i + 1]) : -1;
        const int lo = whole ? hex(text[i + 2]) : -1;
        if (hi < 0 || lo < 0) {
          ThrowInvalid("shared_cache_url: a '%' in the credentials must start a %XX escape");
        }
        const char decoded = static_cast<char>(hi * 16 + lo);
        if (static_cast<unsigned char>(decoded) < 0x20) ThrowInvalid("shared_cache_url: a control character in the credentials");
        out += decoded;
        i += 2;
      }
      return out;
    };
    const std::size_t colon = info.find(':');
    if (colon == std::string::npos) {
      a.password = decode(info);  // redis://secret@host: a password for the default user
    } else {
      a.user = decode(info.substr(0, colon));
      a.password = decode(info.substr(colon + 1));
    }
    if (a.password.empty()) ThrowInvalid("shared_cache_url: credentials without a password (user:password@host)");
  }
  const std::size_t slash = rest.find('/');
  // The credentials never appear in an error: the URL is shown without them.
  const std::string shown = at == std::string::npos ? url : detail::Concat(scheme, "***@", rest);
  auto number = [&](const std::string& text, const char* what, int lo, int hi) {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || errno != 0 || *end != '\0' || v < lo || v > hi) {
      ThrowInvalid("shared_cache_url '", shown, "': ", what, " must be an integer in ", lo, "..", hi, ", got '", text,
                   "'");
    }
    return static_cast<int>(v);
  };
  if (slash != std::string::npos) {
    const std::string db = rest.substr(slash + 1);
    if (!db.empty()) a.db = number(db, "the database", 0, 1 << 20);
    rest.resize(slash);
  }
  const std::size_t colon = rest.rfind(':');
  if (colon != std::string::npos) {
    a.port = number(rest.substr(colon + 1), "the port", 1, 65535);
    rest.resize(colon);
  }
  if (rest.empty()) ThrowInvalid("shared_cache_url '", shown, "' names no host");
  a.host = rest;
  return a;
}

RedisAddress ResolveRedisUrl(const std::string& url, const char* password_env) {
  RedisAddress a = ParseRedisUrl(url);
  if (a.password.empty() && password_env != nullptr) {
    const char* secret = std::getenv(password_env);
    if (secret != nullptr) a.password = secret;
  }
  return a;
}

void RespConnection::Append(std::string* wire, const std::vector<std::pair<const void*, std::size_t>>& args) {
  *wire += detail::Concat("*", args.size(), "\r\n");
  for (const auto& [data, bytes] : args) {
    *wire += detail::Concat("$", bytes, "\r\n");
    wire->append(static_cast<const char*>(data), bytes);
    *wire += "\r\n";
  }
}

bool RespConnection::Call(const std::string& wire, std::size_t count, std::vector<RespReply>* replies,
                          std::int64_t deadline) {
  replies->clear();
  if (fd_ < 0 && !Connect(deadline)) return false;
  if (!Send(wire, deadline) || !Receive(count, replies, deadline)) {
    if (NowMs() < deadline) return Fail();
    // Out of time on a live connection: a slow store (or a large reply), not a gone one. The
    // replies still due would garble the next call, so the connection closes, but the next
    // call connects again at once.
    Close();
    return false;
  }
  if (!replies->empty() && (*replies)[0].type == '-' && (*replies)[0].text.rfind("NOAUTH", 0) == 0) {
    ++auth_failures_;  // the store wants a password the manager was not given
    return Fail();
  }
  backoff_ms_ = 0;
  return true;
}

bool RespConnection::Connect(std::int64_t deadline_ms) {
  if (NowMs() < retry_at_ms_) return false;  // backing off after a failure
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(address_.port);
  if (getaddrinfo(address_.host.c_str(), port.c_str(), &hints, &found) != 0 || found == nullptr) return Fail();
  fd_ = socket(found->ai_family, found->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, found->ai_protocol);
  bool ok = fd_ >= 0;
  if (ok && connect(fd_, found->ai_addr, found->ai_addrlen) != 0) {
    ok = errno == EINPROGRESS && Wait(fd_, POLLOUT, deadline_ms);
    int err = 0;
    socklen_t len = sizeof err;
    ok = ok && getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
  }
  freeaddrinfo(found);
  if (!ok) return Fail();
  const int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  in_.clear();
  return Handshake(deadline_ms) || Fail();
}

bool RespConnection::Handshake(std::int64_t deadline_ms) {
  std::string wire;
  std::size_t count = 0;
  const RedisAddress& a = address_;
  if (!a.password.empty()) {
    if (a.user.empty()) {
      Append(&wire, {{"AUTH", 4}, {a.password.data(), a.password.size()}});
    } else {
      Append(&wire, {{"AUTH", 4}, {a.user.data(), a.user.size()}, {a.password.data(), a.password.size()}});
    }
    ++count;
  }
  const std::string db = std::to_string(a.db);
  if (a.db != 0) {
    Append(&wire, {{"SELECT", 6}, {db.data(), db.size()}});
    ++count;
  }
  if (count == 0) return true;
  std::vector<RespReply> replies;
  if (!Send(wire, deadline_ms) || !Receive(count, &replies, deadline_ms)) return false;
  if (!a.password.empty() && replies[0].type != '+') {
    ++auth_failures_;  // WRONGPASS, or AUTH to a store without a password
    return false;
  }
  // A store that wants a password the manager was not given answers SELECT with NOAUTH.
  if (a.db != 0 && replies.back().type != '+') {
    if (replies.back().text.rfind("NOAUTH", 0) == 0) ++auth_failures_;
    return false;
  }
  return true;
}

bool RespConnection::Send(const std::string& wire, std::int64_t deadline_ms) {
  std::size_t sent = 0;
  while (sent < wire.size()) {
    const ssize_t n = send(fd_, wire.data() + sent, wire.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!Wait(fd_, POLLOUT, deadline_ms)) return false;
    } else {
      return false;
    }
  }
  return true;
}

bool RespConnection::Receive(std::size_t count, std::vector<RespReply>* replies, std::int64_t deadline_ms) {
  std::size_t pos = 0;
  char chunk[kReadChunk];
  while (replies->size() < count) {
    RespReply reply;
    const int parsed = ParseReply(in_, &pos, &reply);
    if (parsed < 0) return false;
    if (parsed > 0) {
      replies->push_back(std::move(reply));
      continue;
    }
    if (!Wait(fd_, POLLIN, deadline_ms)) return false;
    const ssize_t n = recv(fd_, chunk, sizeof chunk, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n <= 0) return false;  // closed by the server, or an error
    in_.append(chunk, static_cast<std::size_t>(n));
  }
  in_.erase(0, pos);
  return true;
}

bool RespConnection::Fail() {
  Close();
  backoff_ms_ = backoff_ms_ == 0 ? kFirstBackoffMs : std::min(kMaxBackoffMs, 2 * backoff_ms_);
  retry_at_ms_ = NowMs() + backoff_ms_;
  return false;
}

void RespConnection::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  in_.clear();
}

SharedTier::SharedTier(RedisAddress address, std::string ns, std::size_t queue_bytes)
    : ns_(std::move(ns)),
      queue_bytes_(queue_bytes),
      lookup_(address),
      writer_conn_(address),
      writer_([this] { WriterLoop(); }) {}

SharedTier::~SharedTier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_.join();  // a batch in flight ends within kWriteTimeoutMs
}

std::string SharedTier::Key(std::int32_t label, std::uint64_t hash) const {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return detail::Concat(ns_, ":w", label, ":", text);
}

bool SharedTier::Exists(const std::vector<std::string>& keys, std::vector<char>* found, std::int64_t deadline_ms) {
  found->assign(keys.size(), 0);
  if (keys.empty()) return true;
  std::string wire;
  for (const std::string& k : keys) RespConnection::Append(&wire, {{"EXISTS", 6}, {k.data(), k.size()}});
  std::vector<RespReply> replies;
  if (!lookup_.Call(wire, keys.size(), &replies, deadline_ms)) {
    CountError();
    return false;
  }
  for (std::size_t i = 0; i < keys.size(); ++i) (*found)[i] = replies[i].type == ':' && replies[i].integer == 1;
  return true;
}

bool SharedTier::Fetch(const std::vector<std::string>& keys, std::vector<std::string>* values,
                       std::int64_t deadline_ms, std::size_t batch) {
  values->assign(keys.size(), std::string());
  batch = std::max<std::size_t>(1, batch);
  std::vector<RespReply> replies;
  for (std::size_t first = 0; first < keys.size(); first += batch) {
    const std::size_t last = std::min(keys.size(), first + batch);
    std::string wire;
    for (std::size_t i = first; i < last; ++i) {
      RespConnection::Append(&wire, {{"GET", 3}, {keys[i].data(), keys[i].size()}});
    }
    const bool ok = lookup_.Call(wire, last - first, &replies, deadline_ms);
    // After a failure, the replies that arrived before it still count. A value that can be no
    // block (empty; an error such as WRONGTYPE for a key of another type) is a refused miss.
    for (std::size_t i = 0; i < replies.size(); ++i) {
      RespReply& r = replies[i];
      if (r.type == '$' && !r.nil && !r.text.empty()) {
        (*values)[first + i] = std::move(r.text);
      } else if (!(r.type == '$' && r.nil)) {
        CountError();
      }
    }
    if (!ok) {
      CountError();
      return false;
    }
  }
  return true;
}

bool SharedTier::Reserve(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (queued_bytes_ > 0 && queued_bytes_ + bytes > queue_bytes_) {
    ++write_drops_;
    return false;
  }
  queued_bytes_ += bytes;
  return true;
}

void SharedTier::Push(std::string key, std::string value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(key), std::move(value));
  }
  cv_.notify_all();
}

bool SharedTier::Flush(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return queue_.empty() && !busy_; });
}

SharedTierCounters SharedTier::Counters() const {
  SharedTierCounters c;
  c.hits = hits_.load();
  c.writes = writes_.load();
  c.write_drops = write_drops_.load();
  c.errors = errors_.load();
  c.auth_failures = lookup_.auth_failures() + writer_conn_.auth_failures();
  return c;
}

void SharedTier::WriterLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    std::deque<std::pair<std::string, std::string>> batch;
    batch.swap(queue_);
    busy_ = true;
    lock.unlock();
    std::string wire;
    std::size_t bytes = 0;
    for (const auto& [key, value] : batch) {
      RespConnection::Append(&wire, {{"SET", 3}, {key.data(), key.size()}, {value.data(), value.size()}});
      bytes += key.size() + value.size();
    }
    std::vector<RespReply> replies;
    if (writer_conn_.Call(wire, batch.size(), &replies, NowMs() + kWriteTimeoutMs)) {
      for (const RespReply& r : replies) (r.type == '+' ? writes_ : errors_) += 1;
    } else {
      ++errors_;
    }
    lock.lock();
    queued_bytes_ -= bytes;
    busy_ = false;
    cv_.notify_all();
  }
}

std::string EncodeSharedBlock(const std::string& key, const unsigned char* data, std::size_t bytes) {
  const std::uint64_t digest = KeyDigest(key);
  const std::uint64_t header[4] = {kMagic, digest, static_cast<std::uint64_t>(bytes), Checksum(digest, data, bytes)};
  static_assert(sizeof header == kSharedBlockHeader, "the documented header size");
  std::string value(kSharedBlockHeader + bytes, '\0');
  std::memcpy(&value[0], header, sizeof header);
  if (bytes > 0) std::memcpy(&value[kSharedBlockHeader], data, bytes);
  return value;
}

const unsigned char* DecodeSharedBlock(const std::string& value, const std::string& key, std::size_t bytes) {
  if (value.size() != kSharedBlockHeader + bytes) return nullptr;
  const std::uint64_t hash = KeyDigest(key);
  std::uint64_t header[4];
  std::memcpy(header, value.data(), sizeof header);
  const auto* data = reinterpret_cast<const unsigned char*>(value.data()) + kSharedBlockHeader;
  if (header[0] != kMagic || header[1] != hash || header[2] != bytes) return nullptr;
  return header[3] == Checksum(hash, data, bytes) ? data : nullptr;
}

}  // namespace kvcache
