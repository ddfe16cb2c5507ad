#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/secondary_tier.h"

namespace kvcache {
namespace {

std::string ErrnoText() { return std::strerror(errno); }

/// One file per window; positioned reads and writes, so no seek state is shared.
class DiskTier final : public SecondaryTier {
 public:
  explicit DiskTier(const std::string& directory) {
    if (directory.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvcache-disk-XXXXXX";
      std::vector<char> buf(pattern.begin(), pattern.end());
      buf.push_back('\0');
      if (mkdtemp(buf.data()) == nullptr) {
        throw KVCacheError(detail::Concat("disk tier: cannot create a directory from ", pattern, ": ", ErrnoText()));
      }
      dir_ = buf.data();
      own_dir_ = true;
    } else {
      dir_ = directory;
      if (mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) {
        throw KVCacheError(detail::Concat("disk tier: cannot create directory ", dir_, ": ", ErrnoText()));
      }
      struct stat st {};
      if (stat(dir_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        throw KVCacheError(detail::Concat("disk tier: ", dir_, " is not a directory"));
      }
    }
  }

  ~DiskTier() override {
    for (const auto& [window, fd] : files_) {
      close(fd);
      unlink(Path(window).c_str());
    }
    if (own_dir_) rmdir(dir_.c_str());
  }

  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  const char* Medium() const override { return "DISK"; }

  bool Put(const TierKey& key, const std::vector<TierSegment>& segments) override {
    const int fd = File(key.window);
    if (fd < 0) return false;
    off_t offset = Offset(key, segments);
    for (const TierSegment& s : segments) {
      if (!Transfer(fd, s.data, s.bytes, offset, /*write=*/true)) return false;
      offset += static_cast<off_t>(s.bytes);
    }
    return true;
  }

  void Get(const TierKey& key, const std::vector<TierSegment>& segments) override {
    const int fd = File(key.window);
    off_t offset = Offset(key, segments);
    for (const TierSegment& s : segments) {
      if (fd < 0 || !Transfer(fd, s.data, s.bytes, offset, /*write=*/false)) {
        throw KVCacheError(detail::Concat("disk tier: cannot read block ", key.slot, " of window ", key.window,
                                          " from ", Path(key.window), ": ", ErrnoText()));
      }
      offset += static_cast<off_t>(s.bytes);
    }
  }

  void Erase(const TierKey& /*key*/) override {
    // The slot's bytes are overwritten by its next Put; the file never grows past the slots.
  }

 private:
  /// Unique per tier instance, so managers sharing a directory never share a file.
  std::string Path(WindowSize window) const {
    return detail::Concat(dir_, "/kvcache-", getpid(), "-", instance_, "-window-", window, ".kvblocks");
  }

  static off_t Offset(const TierKey& key, const std::vector<TierSegment>& segments) {
    std::size_t block = 0;
    for (const TierSegment& s : segments) block += s.bytes;
    return static_cast<off_t>(block * static_cast<std::size_t>(key.slot));
  }

  int File(WindowSize window) {
    auto it = files_.find(window);
    if (it != files_.end()) return it->second;
    const int fd = open(Path(window).c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) files_[window] = fd;
    return fd;
  }

  static bool Transfer(int fd, void* data, std::size_t bytes, off_t offset, bool write) {
    auto* p = static_cast<unsigned char*>(data);
    while (bytes > 0) {
      const ssize_t n = write ? pwrite(fd, p, bytes, offset) : pread(fd, p, bytes, offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      p += n;
      bytes -= static_cast<std::size_t>(n);
      offset += n;
    }
    return true;
  }

  static inline std::atomic<std::uint64_t> next_instance_{0};
  std::uint64_t instance_ = next_instance_++;
  std::string dir_;
  bool own_dir_ = false;
  std::map<WindowSize, int> files_;
};

}  // namespace

std::shared_ptr<SecondaryTier> MakeDiskTier(const std::string& directory) {
  return std::make_shared<DiskTier>(directory);
}

}  // namespace kvcache
