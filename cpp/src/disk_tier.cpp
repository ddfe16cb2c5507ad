#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvcache/block_key.h"
#include "kvcache/errors.h"
#include "kvcache/secondary_tier.h"

namespace kvcache {
namespace {

constexpr std::uint64_t kMagic = 0x3130424b43564b43ULL;  // "CKVCKB01" read as a little-endian word
constexpr std::uint64_t kChecksumSeed = 0x9e3779b97f4a7c15ULL;
constexpr int kIdAttempts = 8;  // ids drawn before giving up on EEXIST (64 random bits: never)

/// The text of an errno value captured right after the failing call.
std::string ErrnoText(int err) { return err == 0 ? "unexpected end of file" : std::strerror(err); }

/// The first bytes of every slot: what the slot holds and a checksum of it.
struct SlotHeader {
  std::uint64_t magic = 0;
  std::uint64_t hash = 0;      ///< TierKey::hash of the content
  std::uint64_t bytes = 0;     ///< the content's size (the sum of the segments)
  std::uint64_t checksum = 0;  ///< HashBytes over the segments, in order
};
static_assert(sizeof(SlotHeader) == kDiskSlotHeader, "the documented header size");

std::uint64_t Checksum(const std::vector<TierSegment>& segments) {
  std::uint64_t h = kChecksumSeed;
  for (const TierSegment& s : segments) h = HashBytes(h, s.data, s.bytes);
  return h;
}

std::size_t TotalBytes(const std::vector<TierSegment>& segments) {
  std::size_t total = 0;
  for (const TierSegment& s : segments) total += s.bytes;
  return total;
}

/// Skips the entries of iov[*i..) that `done` bytes completed (and empty ones).
void Advance(std::vector<iovec>* iov, std::size_t* i, std::size_t done) {
  std::vector<iovec>& v = *iov;
  while (*i < v.size() && (done >= v[*i].iov_len)) {
    done -= v[*i].iov_len;
    ++*i;
  }
  if (*i < v.size() && done > 0) {
    v[*i].iov_base = static_cast<unsigned char*>(v[*i].iov_base) + done;
    v[*i].iov_len -= done;
  }
}

/// Reads or writes all of `iov` from `offset` with vectored calls (one request for a slot's
/// header and bytes); false on an error or end of file.
bool Transfer(int fd, std::vector<iovec> iov, off_t offset, bool write) {
  std::size_t i = 0;
  Advance(&iov, &i, 0);
  while (i < iov.size()) {
    const int count = static_cast<int>(std::min<std::size_t>(iov.size() - i, IOV_MAX));
    const ssize_t n = write ? pwritev(fd, &iov[i], count, offset) : preadv(fd, &iov[i], count, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    offset += n;
    Advance(&iov, &i, static_cast<std::size_t>(n));
  }
  return true;
}

/// The slot's header, then its segments.
std::vector<iovec> SlotVector(SlotHeader* header, const std::vector<TierSegment>& segments) {
  std::vector<iovec> iov;
  iov.reserve(segments.size() + 1);
  iov.push_back({header, sizeof *header});
  for (const TierSegment& s : segments) iov.push_back({s.data, s.bytes});
  return iov;
}

/// A random 64-bit id as 16 hex digits (std::random_device: getrandom or /dev/urandom on Linux).
std::string RandomId() {
  std::uint64_t id = 0;
  try {
    std::random_device device;
    id = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  } catch (const std::exception& e) {
    throw KVCacheError(detail::Concat("disk tier: no random source for the file names: ", e.what()));
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(id));
  return text;
}

/// Creates `path` (it must not exist) and takes an exclusive flock on it; -1 with errno set.
int CreateLocked(const std::string& path) {
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    unlink(path.c_str());
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

/// One file per window; positioned reads and writes, so no seek state is shared.
class DiskTier final : public SecondaryTier {
 public:
  explicit DiskTier(const std::string& directory) {
    OpenDirectory(directory);
    for (int attempt = 1;; ++attempt) {
      id_ = RandomId();
      lock_fd_ = CreateLocked(LockPath());
      if (lock_fd_ >= 0) break;
      const int err = errno;
      if (err != EEXIST || attempt == kIdAttempts) {
        if (own_dir_) rmdir(dir_.c_str());
        throw KVCacheError(detail::Concat("disk tier: cannot create a file in ", dir_, " (", LockPath(),
                                          "): ", ErrnoText(err)));
      }
    }
  }

  ~DiskTier() override {
    // Unlinked before closed: a name never outlives its lock.
    for (const auto& [window, fd] : files_) {
      unlink(Path(window).c_str());
      close(fd);
    }
    unlink(LockPath().c_str());
    close(lock_fd_);
    if (own_dir_) rmdir(dir_.c_str());
  }

  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  const char* Medium() const override { return "DISK"; }

  bool Put(const TierKey& key, const std::vector<TierSegment>& segments) override {
    const int fd = File(key.window);
    if (fd < 0) return false;
    SlotHeader header;
    header.magic = kMagic;
    header.hash = key.hash;
    header.bytes = TotalBytes(segments);
    header.checksum = Checksum(segments);
    return Transfer(fd, SlotVector(&header, segments), Offset(key, header.bytes), /*write=*/true);
  }

  bool Get(const TierKey& key, const std::vector<TierSegment>& segments) override {
    const auto it = files_.find(key.window);
    if (it == files_.end()) return false;
    const std::size_t total = TotalBytes(segments);
    SlotHeader header;
    if (!Transfer(it->second, SlotVector(&header, segments), Offset(key, total), /*write=*/false)) return false;
    return header.magic == kMagic && header.hash == key.hash && header.bytes == total &&
           Checksum(segments) == header.checksum;
  }

  void Erase(const TierKey& /*key*/) override {
    // The slot's bytes are overwritten by its next Put; the file never grows past the slots.
  }

 private:
  void OpenDirectory(const std::string& directory) {
    if (directory.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvcache-disk-XXXXXX";
      std::vector<char> buf(pattern.begin(), pattern.end());
      buf.push_back('\0');
      if (mkdtemp(buf.data()) == nullptr) {
        const int err = errno;
        throw KVCacheError(detail::Concat("disk tier: cannot create a directory from ", pattern, ": ", ErrnoText(err)));
      }
      dir_ = buf.data();
      own_dir_ = true;
      return;
    }
    dir_ = directory;
    if (mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) {
      const int err = errno;
      throw KVCacheError(detail::Concat("disk tier: cannot create directory ", dir_, ": ", ErrnoText(err)));
    }
    struct stat st {};
    if (stat(dir_.c_str(), &st) != 0) {
      const int err = errno;
      throw KVCacheError(detail::Concat("disk tier: cannot use directory ", dir_, ": ", ErrnoText(err)));
    }
    if (!S_ISDIR(st.st_mode)) throw KVCacheError(detail::Concat("disk tier: ", dir_, " is not a directory"));
  }

  std::string LockPath() const { return detail::Concat(dir_, "/kvcache-", id_, ".lock"); }
  std::string Path(WindowSize window) const {
    return detail::Concat(dir_, "/kvcache-", id_, "-window-", window, ".kvblocks");
  }

  static off_t Offset(const TierKey& key, std::size_t block_bytes) {
    return static_cast<off_t>((kDiskSlotHeader + block_bytes) * static_cast<std::size_t>(key.slot));
  }

  /// The window's file, created (exclusively, locked) on its first use; -1 if it cannot be.
  int File(WindowSize window) {
    const auto it = files_.find(window);
    if (it != files_.end()) return it->second;
    const int fd = CreateLocked(Path(window));
    if (fd >= 0) files_[window] = fd;
    return fd;
  }

  std::string dir_;
  bool own_dir_ = false;
  std::string id_;
  int lock_fd_ = -1;
  std::map<WindowSize, int> files_;
};

}  // namespace

std::shared_ptr<SecondaryTier> MakeDiskTier(const std::string& directory) {
  return std::make_shared<DiskTier>(directory);
}

}  // namespace kvcache
