#include "kvcache/errors.h"

#include <string>

namespace kvcache {

UnknownSequenceError::UnknownSequenceError(SeqId id)
    : std::out_of_range(detail::Concat("unknown request id ", id)), id_(id) {}

namespace detail {
void ThrowInternal(const char* file, int line, const char* cond, const std::string& msg) {
  throw InternalError(Concat("kvcache internal check failed: ", msg, " (", cond, " at ", file, ":",
                             line, ")"));
}
}  // namespace detail

int DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFp8:
    case DType::kInt8:
      return 1;
  }
  return 0;
}

DType ParseDType(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "fp8") return DType::kFp8;
  if (name == "int8") return DType::kInt8;
  ThrowInvalid("unknown dtype '", name, "' (expected float32, float16, bfloat16, fp8 or int8)");
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFp8:
      return "fp8";
    case DType::kInt8:
      return "int8";
  }
  return "?";
}

BackendKind ParseBackendKind(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "cuda") return BackendKind::kCuda;
  if (name == "host") return BackendKind::kHost;
  if (name == "virtual") return BackendKind::kVirtual;
  ThrowInvalid("unknown backend '", name, "' (expected auto, cuda, host or virtual)");
}

std::string BackendName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto:
      return "auto";
    case BackendKind::kCuda:
      return "cuda";
    case BackendKind::kHost:
      return "host";
    case BackendKind::kVirtual:
      return "virtual";
  }
  return "?";
}

}  // namespace kvcache
