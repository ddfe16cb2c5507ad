// The shared tier's parts that need no server: URL parsing, the stored block format and its
// checks, and a store nobody listens on (a miss and a counter). The server path (hits across
// managers, a killed, flushed, stalled or corrupt store) is tested in tests/python.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcache/kv_cache_manager.h"
#include "kvcache/shared_tier.h"
#include "test_util.h"

namespace kvcache {
namespace {

using testing::Config;
using testing::Iota;
using testing::Model;

/// A TCP port on 127.0.0.1 that nobody listens on (bound, then closed).
int DeadPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  close(fd);
  return ntohs(a.sin_port);
}

std::string ErrorOf(const std::string& url) {
  try {
    ParseRedisUrl(url);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(SharedTier, ParsesRedisUrls) {
  const RedisAddress plain = ParseRedisUrl("redis://cache.local");
  EXPECT_EQ(plain.host, "cache.local");
  EXPECT_EQ(plain.port, 6379);
  EXPECT_EQ(plain.db, 0);
  const RedisAddress full = ParseRedisUrl("redis://127.0.0.1:7000/3");
  EXPECT_EQ(full.host, "127.0.0.1");
  EXPECT_EQ(full.port, 7000);
  EXPECT_EQ(full.db, 3);
  EXPECT_EQ(ParseRedisUrl("redis://h:1/").db, 0);
  EXPECT_NE(ErrorOf("http://h:1").find("must look like redis://[[user]:password@]host[:port][/db]"),
            std::string::npos);
  EXPECT_NE(ErrorOf("redis://h:0").find("the port must be an integer in 1..65535, got '0'"), std::string::npos);
  EXPECT_NE(ErrorOf("redis://h:x1").find("the port must be an integer"), std::string::npos);
  EXPECT_NE(ErrorOf("redis://h:1/a").find("the database must be an integer"), std::string::npos);
  EXPECT_NE(ErrorOf("redis://:1").find("names no host"), std::string::npos);
}

TEST(SharedTier, ParsesCredentialsAndRefusesWhatItCannotSpeak) {
  const RedisAddress both = ParseRedisUrl("redis://alice:s%40cr%3At@cache:7000/2");
  EXPECT_EQ(both.user, "alice");
  EXPECT_EQ(both.password, "s@cr:t");  // percent-decoded
  EXPECT_EQ(both.host, "cache");
  EXPECT_EQ(both.port, 7000);
  EXPECT_EQ(both.db, 2);
  const RedisAddress alone = ParseRedisUrl("redis://:secret@h");
  EXPECT_EQ(alone.user, "");
  EXPECT_EQ(alone.password, "secret");
  EXPECT_EQ(ParseRedisUrl("redis://secret@h").password, "secret");
  EXPECT_EQ(ParseRedisUrl("redis://h").password, "");
  EXPECT_NE(ErrorOf("rediss://h:6380").find("TLS (rediss://) is not spoken"), std::string::npos);
  EXPECT_NE(ErrorOf(std::string("redis://h\0x:1", 13)).find("control characters"), std::string::npos);
  EXPECT_NE(ErrorOf("redis://h:1\n").find("control characters"), std::string::npos);
  EXPECT_NE(ErrorOf("redis://u:@h").find("credentials without a password"), std::string::npos);
  EXPECT_NE(ErrorOf("redis://u:p%4@h").find("%XX escape"), std::string::npos);
  // The password never shows in an error.
  const std::string error = ErrorOf("redis://u:hunter2@h:99999");
  EXPECT_NE(error.find("the port must be"), std::string::npos);
  EXPECT_EQ(error.find("hunter2"), std::string::npos);
}

TEST(SharedTier, APasswordComesFromTheEnvironmentOnlyWhenTheUrlHasNone) {
  const char* name = "KVCACHE_TEST_SHARED_PASSWORD";
  unsetenv(name);
  EXPECT_EQ(ResolveRedisUrl("redis://h", name).password, "");
  setenv(name, "from-env", 1);
  EXPECT_EQ(ResolveRedisUrl("redis://h", name).password, "from-env");
  EXPECT_EQ(ResolveRedisUrl("redis://u:from-url@h", name).password, "from-url");
  unsetenv(name);
}

TEST(SharedTier, AStoredBlockReadsBackOnlyUnderItsKeyAndIntact) {
  std::vector<unsigned char> bytes(100);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 1);
  const std::string key = "ns:w8:000000000000002a";
  const std::string value = EncodeSharedBlock(key, bytes.data(), bytes.size());
  ASSERT_EQ(value.size(), kSharedBlockHeader + 100);
  const unsigned char* data = DecodeSharedBlock(value, key, 100);
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(std::vector<unsigned char>(data, data + 100), bytes);
  // The whole key is bound: another hash, another window, another namespace.
  EXPECT_EQ(DecodeSharedBlock(value, "ns:w8:000000000000002b", 100), nullptr);
  EXPECT_EQ(DecodeSharedBlock(value, "ns:w0:000000000000002a", 100), nullptr);
  EXPECT_EQ(DecodeSharedBlock(value, "other:w8:000000000000002a", 100), nullptr);
  EXPECT_EQ(DecodeSharedBlock(value, key, 99), nullptr);  // another layout's size
  std::string flipped = value;
  flipped[kSharedBlockHeader + 50] = static_cast<char>(flipped[kSharedBlockHeader + 50] ^ 1);
  EXPECT_EQ(DecodeSharedBlock(flipped, key, 100), nullptr);  // the checksum fails
  EXPECT_EQ(DecodeSharedBlock(value.substr(0, value.size() - 1), key, 100), nullptr);  // truncated
  EXPECT_EQ(DecodeSharedBlock("", key, 100), nullptr);  // missing
}

TEST(SharedTier, AConnectionToNobodyFailsAndBacksOff) {
  RespConnection c(RedisAddress{"127.0.0.1", DeadPort(), 0, "", ""});
  std::string wire;
  RespConnection::Append(&wire, {{"PING", 4}});
  std::vector<RespReply> replies;
  EXPECT_FALSE(c.Call(wire, 1, &replies, RespConnection::NowMs() + 1000));
  EXPECT_TRUE(replies.empty());
  EXPECT_FALSE(c.Call(wire, 1, &replies, RespConnection::NowMs() + 1000));  // within the backoff
  EXPECT_EQ(wire, "*1\r\n$4\r\nPING\r\n");
}

TEST(SharedTier, AStoreNobodyListensOnIsAMissAndACounter) {
  ManagerConfig c = Config({8, 0}, 64, {{8, 8}, {64, 16}}, /*tpb=*/4, BackendKind::kHost);
  c.enable_block_reuse = true;
  c.shared_cache_url = "redis://127.0.0.1:" + std::to_string(DeadPort());
  KVCacheManager m(Model(4), c);
  EXPECT_EQ(m.shared_cache_namespace().rfind("kvcache:", 0), 0u);
  EXPECT_EQ(m.shared_cache_namespace().size(), 24u);
  const std::vector<TokenId> prompt = Iota(30);
  EXPECT_EQ(m.AddSequence(1, prompt.data(), prompt.size(), {}), 0);
  KvCacheStats s = m.GetStats();
  EXPECT_EQ(s.shared_errors, 1);
  EXPECT_EQ(s.shared_hits, 0);
  EXPECT_EQ(s.missed_blocks, 16);
  m.CheckInvariants();
  m.RemoveSequence(1);  // stores 7 full blocks per window: queued, then refused by nobody
  EXPECT_TRUE(m.FlushSharedCache(10000));
  s = m.GetStats();
  EXPECT_EQ(s.shared_writes, 0);
  EXPECT_GE(s.shared_errors, 2);
  EXPECT_EQ(s.free_num_blocks, 24);
  // The reuse query probes the store for blocks past the local hit (7 blocks and a 1-token
  // partial match): a miss, counted, nothing thrown. Within the local hit it asks nothing.
  const std::int64_t errors = s.shared_errors;
  EXPECT_EQ(m.GetReusablePrefixLength(prompt.data(), prompt.size(), {}), 29);
  EXPECT_EQ(m.GetStats().shared_errors, errors);
  const std::vector<TokenId> longer = Iota(38);
  EXPECT_EQ(m.GetReusablePrefixLength(longer.data(), longer.size(), {}), 29);
  EXPECT_EQ(m.GetStats().shared_errors, errors + 1);
  m.CheckInvariants();
}

TEST(SharedTier, BadSettingsAreRefusedBeforeAnythingIsAllocated) {
  ManagerConfig c = Config({}, 64, {{64, 4}}, /*tpb=*/4, BackendKind::kHost);
  c.shared_cache_url = "redis://127.0.0.1:1";
  EXPECT_THROW(KVCacheManager(Model(2), c), std::invalid_argument);  // no block reuse
  c.enable_block_reuse = true;
  c.shared_cache_timeout_ms = 0;
  EXPECT_THROW(KVCacheManager(Model(2), c), std::invalid_argument);
  c.shared_cache_timeout_ms = 5;
  c.backend = BackendKind::kVirtual;
  EXPECT_THROW(KVCacheManager(Model(2), c), std::invalid_argument);
  c.backend = BackendKind::kHost;
  c.shared_cache_url.clear();
  c.shared_cache_namespace = "ns";
  EXPECT_THROW(KVCacheManager(Model(2), c), std::invalid_argument);
}

}  // namespace
}  // namespace kvcache
