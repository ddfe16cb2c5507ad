// Exception types and the check macros. Python mapping (see docs/design.md):
//   KVCacheError -> kvcache.KVCacheError(RuntimeError), OutOfBlocksError -> kvcache.OutOfBlocksError,
//   InternalError / CudaError / DeviceOOMError -> subclasses of KVCacheError,
//   UnknownSequenceError -> KeyError, std::invalid_argument -> ValueError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvcache/types.h"

namespace kvcache {

/// Base of the library's own run-time errors.
class KVCacheError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A call needed more free blocks than a window had; nothing was changed.
class OutOfBlocksError : public KVCacheError {
 public:
  using KVCacheError::KVCacheError;
};

/// An internal invariant does not hold (a bug in kvcache, or check_invariants found corruption).
class InternalError : public KVCacheError {
 public:
  using KVCacheError::KVCacheError;
};

/// A CUDA runtime call failed.
class CudaError : public KVCacheError {
 public:
  CudaError(int code, const std::string& what) : KVCacheError(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// The device ran out of memory while allocating a pool.
class DeviceOOMError : public CudaError {
 public:
  using CudaError::CudaError;
};

/// The request id is not registered with the manager (Python KeyError).
class UnknownSequenceError : public std::out_of_range {
 public:
  explicit UnknownSequenceError(SeqId id);
  SeqId id() const noexcept { return id_; }

 private:
  SeqId id_;
};

namespace detail {
template <typename... Args>
std::string Concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void ThrowInternal(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

/// Throws std::invalid_argument (Python ValueError) with the concatenated message.
template <typename... Args>
[[noreturn]] void ThrowInvalid(Args&&... args) {
  throw std::invalid_argument(detail::Concat(std::forward<Args>(args)...));
}

}  // namespace kvcache

/// Always-on internal check: throws kvcache::InternalError.
#define KVC_CHECK(cond, msg)                                                \
  do {                                                                      \
    if (!(cond)) ::kvcache::detail::ThrowInternal(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

#ifdef KVCACHE_ENABLE_DCHECK
#define KVC_DCHECK(cond, msg) KVC_CHECK(cond, msg)
#else
#define KVC_DCHECK(cond, msg) \
  do {                        \
  } while (0)
#endif
