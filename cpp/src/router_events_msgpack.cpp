// Router events from raw msgpack: a validating reader of exactly what a KVEventBatch may
// hold, the checks kvcache.router makes, and Python-style reprs for the messages.
#include "kvcache/router_index.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace kvcache {
namespace {

// ---- msgpack: a validating reader of exactly what a KVEventBatch may hold -----------------

constexpr int kMaxDepth = 64;
constexpr std::size_t kReprMax = 80;  // Python's {value!r:.80}

/// Bytes of a value that begins with byte c and has a fixed size (0: sized by what follows).
struct FixedSizes {
  std::uint8_t size[256] = {};
  constexpr FixedSizes() {
    for (int c = 0; c <= 0x7f; ++c) size[c] = 1;
    for (int c = 0xe0; c <= 0xff; ++c) size[c] = 1;
    size[0xc0] = size[0xc2] = size[0xc3] = 1;
    size[0xcc] = size[0xd0] = 2;
    size[0xcd] = size[0xd1] = 3;
    size[0xca] = size[0xce] = size[0xd2] = 5;
    size[0xcb] = size[0xcf] = size[0xd3] = 9;
    size[0xd4] = 3;
    size[0xd5] = 4;
    size[0xd6] = 6;
    size[0xd7] = 10;
    size[0xd8] = 18;
  }
};
constexpr FixedSizes kFixed;

[[noreturn]] void NotMsgpack(const std::string& why) {
  throw std::invalid_argument("not a msgpack KVEventBatch: " + why);
}

struct Value {
  enum Type : std::uint8_t { kNil, kBool, kUInt, kInt, kFloat, kStr, kBin, kArray, kMap, kExt };
  Type type = kNil;
  bool b = false;
  std::uint64_t u = 0;  // kUInt
  std::int64_t i = 0;   // kInt (negative only: a non-negative int is kUInt)
  double f = 0;
  const char* p = nullptr;  // kStr, kBin, kExt: the bytes
  std::uint32_t n = 0;      // kStr, kBin, kExt: bytes; kArray: items; kMap: pairs
  std::int8_t ext = 0;
  bool IsInt() const { return type == kUInt || type == kInt; }
  std::string_view Str() const { return {p, n}; }
};

/// A cursor over a payload that was checked whole by Validate() first: Next() reads one value's
/// header (a container's items follow it), Skip() skips one value whole.
class Cursor {
 public:
  Cursor(const char* p, const char* end) : p_(p), end_(end) {}
  const char* pos() const { return p_; }
  bool done() const { return p_ == end_; }

  Value Next() {
    Value v;
    const auto c = Byte();
    if (c <= 0x7f) return UInt(c);
    if (c >= 0xe0) {
      v.type = Value::kInt;
      v.i = static_cast<std::int8_t>(c);
      return v;
    }
    if (c >= 0x80 && c <= 0x8f) return Container(Value::kMap, c & 0x0fU);
    if (c >= 0x90 && c <= 0x9f) return Container(Value::kArray, c & 0x0fU);
    if (c >= 0xa0 && c <= 0xbf) return Bytes(Value::kStr, c & 0x1fU);
    switch (c) {
      case 0xc0:
        return v;
      case 0xc2:
      case 0xc3:
        v.type = Value::kBool;
        v.b = c == 0xc3;
        return v;
      case 0xc4:
        return Bytes(Value::kBin, Be(1));
      case 0xc5:
        return Bytes(Value::kBin, Be(2));
      case 0xc6:
        return Bytes(Value::kBin, Be(4));
      case 0xc7:
      case 0xc8:
      case 0xc9: {
        const auto n = Be(c == 0xc7 ? 1 : c == 0xc8 ? 2 : 4);
        v = Bytes(Value::kExt, 0, true);
        v.ext = static_cast<std::int8_t>(Be(1));
        return Fill(v, n);
      }
      case 0xca: {
        std::uint32_t bits = static_cast<std::uint32_t>(Be(4));
        float f = 0;
        std::memcpy(&f, &bits, sizeof f);
        v.type = Value::kFloat;
        v.f = f;
        return v;
      }
      case 0xcb: {
        std::uint64_t bits = Be(8);
        double d = 0;
        std::memcpy(&d, &bits, sizeof d);
        v.type = Value::kFloat;
        v.f = d;
        return v;
      }
      case 0xcc:
        return UInt(Be(1));
      case 0xcd:
        return UInt(Be(2));
      case 0xce:
        return UInt(Be(4));
      case 0xcf:
        return UInt(Be(8));
      case 0xd0:
        return Int(static_cast<std::int8_t>(Be(1)));
      case 0xd1:
        return Int(static_cast<std::int16_t>(Be(2)));
      case 0xd2:
        return Int(static_cast<std::int32_t>(Be(4)));
      case 0xd3:
        return Int(static_cast<std::int64_t>(Be(8)));
      case 0xd4:
      case 0xd5:
      case 0xd6:
      case 0xd7:
      case 0xd8: {
        v = Bytes(Value::kExt, 0, true);
        v.ext = static_cast<std::int8_t>(Be(1));
        return Fill(v, 1U << (c - 0xd4));
      }
      case 0xd9:
        return Bytes(Value::kStr, Be(1));
      case 0xda:
        return Bytes(Value::kStr, Be(2));
      case 0xdb:
        return Bytes(Value::kStr, Be(4));
      case 0xdc:
        return Container(Value::kArray, Be(2));
      case 0xdd:
        return Container(Value::kArray, Be(4));
      case 0xde:
        return Container(Value::kMap, Be(2));
      case 0xdf:
        return Container(Value::kMap, Be(4));
      default:
        NotMsgpack("invalid byte 0x" + Hex(c));
    }
  }

  /// Skips one value whole; checks every string is UTF-8 and nesting stays within kMaxDepth.
  /// Iterative, one table-free byte switch per value: token_ids arrays are most of a batch.
  void Skip() {
    std::uint64_t left[kMaxDepth + 1];
    int depth = 0;
    left[0] = 1;
    for (;;) {
      while (left[depth] == 0) {
        if (depth == 0) return;
        --depth;
      }
      --left[depth];
      if (p_ == end_) NotMsgpack("input data was truncated");
      const auto fixed = kFixed.size[static_cast<unsigned char>(*p_)];
      if (fixed != 0) {  // a scalar: the arrays of ints (token_ids, block_hashes) go here
        Advance(fixed);
        continue;
      }
      const unsigned c = Byte();
      std::uint64_t items = 0;
      if (c <= 0x8f) {  // fixmap (the positive fixints were skipped above)
        items = 2ULL * (c & 0x0fU);
      } else if (c <= 0x9f) {
        items = c & 0x0fU;
      } else if (c <= 0xbf) {
        SkipStr(c & 0x1fU);
        continue;
      } else {
        switch (c) {  // the fixed-size scalars (nil, bools, numbers, fixext) were skipped above
          case 0xc4:
            Advance(Be(1));
            continue;
          case 0xc5:
            Advance(Be(2));
            continue;
          case 0xc6:
            Advance(Be(4));
            continue;
          case 0xc7:
            Advance(Be(1) + 1);
            continue;
          case 0xc8:
            Advance(Be(2) + 1);
            continue;
          case 0xc9:
            Advance(Be(4) + 1);
            continue;
          case 0xd9:
            SkipStr(Be(1));
            continue;
          case 0xda:
            SkipStr(Be(2));
            continue;
          case 0xdb:
            SkipStr(Be(4));
            continue;
          case 0xdc:
            items = Be(2);
            break;
          case 0xdd:
            items = Be(4);
            break;
          case 0xde:
            items = 2 * Be(2);
            break;
          case 0xdf:
            items = 2 * Be(4);
            break;
          default:
            NotMsgpack("invalid byte 0x" + Hex(c));
        }
      }
      if (items == 0) continue;
      if (items > static_cast<std::uint64_t>(end_ - p_)) NotMsgpack("input data was truncated");
      if (depth + 1 > kMaxDepth) NotMsgpack("nested deeper than " + std::to_string(kMaxDepth) + " levels");
      left[++depth] = items;
    }
  }

 private:
  void Advance(std::uint64_t n) {
    if (n > static_cast<std::uint64_t>(end_ - p_)) NotMsgpack("input data was truncated");
    p_ += n;
  }
  void SkipStr(std::uint64_t n) {
    if (n > static_cast<std::uint64_t>(end_ - p_)) NotMsgpack("input data was truncated");
    if (!Utf8(p_, static_cast<std::uint32_t>(n))) NotMsgpack("invalid UTF-8 in a str");
    p_ += n;
  }
  unsigned Byte() {
    if (p_ == end_) NotMsgpack("input data was truncated");
    return static_cast<unsigned char>(*p_++);
  }
  std::uint64_t Be(int bytes) {
    if (end_ - p_ < bytes) NotMsgpack("input data was truncated");
    std::uint64_t x = 0;
    for (int k = 0; k < bytes; ++k) x = (x << 8) | static_cast<unsigned char>(*p_++);
    return x;
  }
  static Value UInt(std::uint64_t u) {
    Value v;
    v.type = Value::kUInt;
    v.u = u;
    return v;
  }
  static Value Int(std::int64_t i) {
    if (i >= 0) return UInt(static_cast<std::uint64_t>(i));
    Value v;
    v.type = Value::kInt;
    v.i = i;
    return v;
  }
  Value Container(Value::Type type, std::uint64_t n) {
    Value v;
    v.type = type;
    // Every item takes at least one byte (a map's pair two): a count the data cannot hold is
    // truncated data, not a huge allocation later.
    if (n > static_cast<std::uint64_t>(end_ - p_)) NotMsgpack("input data was truncated");
    v.n = static_cast<std::uint32_t>(n);
    return v;
  }
  Value Bytes(Value::Type type, std::uint64_t n, bool defer = false) {
    Value v;
    v.type = type;
    return defer ? v : Fill(v, n);
  }
  Value Fill(Value v, std::uint64_t n) {
    if (n > static_cast<std::uint64_t>(end_ - p_)) NotMsgpack("input data was truncated");
    v.p = p_;
    v.n = static_cast<std::uint32_t>(n);
    p_ += n;
    return v;
  }
  static std::string Hex(unsigned c) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "%02x", c);
    return buf;
  }
  static bool Utf8(const char* s, std::uint32_t n) {
    const auto* u = reinterpret_cast<const unsigned char*>(s);
    std::uint32_t k = 0;
    while (k < n) {
      const unsigned c = u[k];
      if (c < 0x80) {
        ++k;
        continue;
      }
      int more = 0;
      unsigned lo = 0x80, hi = 0xbf;
      if (c >= 0xc2 && c <= 0xdf) {
        more = 1;
      } else if (c >= 0xe0 && c <= 0xef) {
        more = 2;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;  // no surrogates
      } else if (c >= 0xf0 && c <= 0xf4) {
        more = 3;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
      } else {
        return false;
      }
      if (n - k <= static_cast<std::uint32_t>(more)) return false;
      for (int j = 1; j <= more; ++j) {
        const unsigned d = u[k + j];
        if (d < (j == 1 ? lo : 0x80U) || d > (j == 1 ? hi : 0xbfU)) return false;
      }
      k += static_cast<std::uint32_t>(more) + 1;
    }
    return true;
  }

  const char* p_;
  const char* end_;
};

// ---- Python-style repr of a msgpack value (for the messages) ------------------------------

void ReprStr(std::string_view s, char prefix, std::string* out) {
  const bool dq = s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char q = dq ? '"' : '\'';
  if (prefix != 0) out->push_back(prefix);
  out->push_back(q);
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == q || ch == '\\') {
      out->push_back('\\');
      out->push_back(ch);
    } else if (ch == '\n') {
      *out += "\\n";
    } else if (ch == '\r') {
      *out += "\\r";
    } else if (ch == '\t') {
      *out += "\\t";
    } else if (c < 0x20 || c == 0x7f || (prefix == 'b' && c >= 0x80)) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      *out += buf;
    } else {
      out->push_back(ch);
    }
    if (out->size() > kReprMax) return;
  }
  out->push_back(q);
}

std::string ReprFloat(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[40];
  if (d == std::floor(d) && std::fabs(d) < 1e16) {
    std::snprintf(buf, sizeof buf, "%.1f", d);
    return buf;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  return buf;
}

void Repr(Cursor& c, std::string* out) {
  const Value v = c.Next();
  switch (v.type) {
    case Value::kNil:
      *out += "None";
      return;
    case Value::kBool:
      *out += v.b ? "True" : "False";
      return;
    case Value::kUInt:
      *out += std::to_string(v.u);
      return;
    case Value::kInt:
      *out += std::to_string(v.i);
      return;
    case Value::kFloat:
      *out += ReprFloat(v.f);
      return;
    case Value::kStr:
      ReprStr(v.Str(), 0, out);
      return;
    case Value::kBin:
      ReprStr(v.Str(), 'b', out);
      return;
    case Value::kExt:
      *out += "Ext(" + std::to_string(v.ext) + ", ";
      ReprStr(v.Str(), 'b', out);
      *out += ")";
      return;
    case Value::kArray:
    case Value::kMap: {
      const bool map = v.type == Value::kMap;
      out->push_back(map ? '{' : '[');
      for (std::uint32_t k = 0; k < v.n; ++k) {
        if (k > 0) *out += ", ";
        if (out->size() > kReprMax) {  // enough for the message: skip the rest
          for (std::uint32_t j = k; j < v.n; ++j) {
            c.Skip();
            if (map) c.Skip();
          }
          return;
        }
        Repr(c, out);
        if (map) {
          *out += ": ";
          Repr(c, out);
        }
      }
      out->push_back(map ? '}' : ']');
      return;
    }
  }
}

std::string ReprAt(const char* p, const char* end) {
  if (p == nullptr) return "None";
  Cursor c(p, end);
  std::string out;
  Repr(c, &out);
  if (out.size() > kReprMax) out.resize(kReprMax);
  return out;
}

// ---- Events: from the validated payload, with the checks kvcache.router makes -------------

enum Field : int {
  kFType = 0,
  kFHashes,
  kFGroup,
  kFMedium,
  kFBlockSize,
  kFSpecKind,
  kFWindow,
  kFLoraId,
  kFLoraName,
  kNumFields
};

int FieldOf(std::string_view name) {
  static const std::pair<std::string_view, int> kNames[] = {
      {"type", kFType},
      {"block_hashes", kFHashes},
      {"group_idx", kFGroup},
      {"medium", kFMedium},
      {"block_size", kFBlockSize},
      {"kv_cache_spec_kind", kFSpecKind},
      {"kv_cache_spec_sliding_window", kFWindow},
      {"lora_id", kFLoraId},
      {"lora_name", kFLoraName},
  };
  for (const auto& [n, f] : kNames) {
    if (n == name) return f;
  }
  return -1;
}

// The array form's fields after the tag (kvcache.router._ARRAY_FIELDS), -1 for those not read.
const std::vector<int>& ArrayFields(RouterEvent::Type type) {
  static const std::vector<int> kStored = {kFHashes, -1,      -1,         kFBlockSize, kFLoraId,
                                           kFMedium, kFLoraName, -1,      kFGroup,     kFSpecKind,
                                           kFWindow, -1,      -1,         -1};
  static const std::vector<int> kRemoved = {kFHashes, kFMedium, kFGroup, -1, -1};
  static const std::vector<int> kCleared = {};
  return type == RouterEvent::kStored ? kStored : type == RouterEvent::kRemoved ? kRemoved : kCleared;
}

bool TypeOf(std::string_view s, RouterEvent::Type* type) {
  if (s == "BlockStored") {
    *type = RouterEvent::kStored;
  } else if (s == "BlockRemoved") {
    *type = RouterEvent::kRemoved;
  } else if (s == "AllBlocksCleared") {
    *type = RouterEvent::kCleared;
  } else {
    return false;
  }
  return true;
}

const char* TypeName(RouterEvent::Type type) {
  return type == RouterEvent::kStored ? "BlockStored" : type == RouterEvent::kRemoved ? "BlockRemoved" : "AllBlocksCleared";
}

const char* FieldName(int f) {
  static const char* kNames[] = {"type",       "block_hashes",       "group_idx",
                                 "medium",     "block_size",         "kv_cache_spec_kind",
                                 "kv_cache_spec_sliding_window", "lora_id", "lora_name"};
  return kNames[f];
}

/// Reads one event (the cursor at its start) into *out, checking what KvIndexer._checked
/// checks, in its order; throws std::invalid_argument naming the event and the field.
void ReadEvent(Cursor& c, const char* end, std::size_t index, RouterEvent* out) {
  const std::string at = "event " + std::to_string(index);
  const char* start = c.pos();
  const Value ev = c.Next();
  const char* pos[kNumFields] = {};  // a field's value (nullptr: absent or nil)
  auto take = [&](int f) {           // the value at the cursor is field f's (or no field's)
    Cursor peek = c;
    const Value v = peek.Next();
    if (f >= 0) pos[f] = v.type == Value::kNil ? nullptr : c.pos();
    c.Skip();
  };
  if (ev.type == Value::kArray) {
    Value tag;
    if (ev.n > 0) {
      Cursor peek = c;
      tag = peek.Next();
    }
    RouterEvent::Type type = RouterEvent::kCleared;
    if (ev.n == 0 || tag.type != Value::kStr || !TypeOf(tag.Str(), &type)) {
      throw std::invalid_argument(at + ": unknown KV event " + ReprAt(start, end));
    }
    c.Skip();  // the tag
    out->type = type;
    const auto& fields = ArrayFields(type);
    for (std::uint32_t k = 1; k < ev.n; ++k) take(k - 1 < fields.size() ? fields[k - 1] : -1);
  } else if (ev.type == Value::kMap) {
    for (std::uint32_t k = 0; k < ev.n; ++k) {
      Cursor peek = c;
      const Value key = peek.Next();
      const int f = key.type == Value::kStr ? FieldOf(key.Str()) : -1;
      c.Skip();  // the key
      take(f);   // the last of equal keys wins, as in a dict
    }
    Value kind;
    if (pos[kFType] != nullptr) kind = Cursor(pos[kFType], end).Next();
    if (kind.type != Value::kStr || !TypeOf(kind.Str(), &out->type)) {
      throw std::invalid_argument(at + ": unknown KV event type " + ReprAt(pos[kFType], end));
    }
  } else {
    throw std::invalid_argument(at + ": unknown KV event " + ReprAt(start, end));
  }
  if (out->type == RouterEvent::kCleared) return;
  const std::string prefix = at + " (" + TypeName(out->type) + "): ";
  auto bad = [&](int f, const char* want) {
    return std::invalid_argument(prefix + FieldName(f) + " must be " + want + ", got " + ReprAt(pos[f], end));
  };
  auto value = [&](int f) { return pos[f] == nullptr ? Value{} : Cursor(pos[f], end).Next(); };

  // block_hashes: a list of ints or bytes.
  if (pos[kFHashes] == nullptr) throw bad(kFHashes, "a list of ints or bytes");
  {
    Cursor h(pos[kFHashes], end);
    const Value list = h.Next();
    if (list.type != Value::kArray) throw bad(kFHashes, "a list of ints or bytes");
    out->hashes.resize(list.n);
    for (std::uint32_t k = 0; k < list.n; ++k) {
      const Value v = h.Next();
      RouterHash& rh = out->hashes[k];
      if (v.type == Value::kUInt) {
        rh.value = v.u;
      } else if (v.type == Value::kInt) {
        rh.kind = RouterHash::kNegative;
        rh.value = static_cast<std::uint64_t>(v.i);
      } else if (v.type == Value::kBin) {
        rh.kind = RouterHash::kOpaque;
        rh.opaque.reserve(v.n + 1);
        rh.opaque.push_back('b');
        rh.opaque.append(v.p, v.n);
      } else {
        throw bad(kFHashes, "a list of ints or bytes");
      }
    }
  }
  const Value group = value(kFGroup);
  if (group.type != Value::kNil && group.type != Value::kUInt) throw bad(kFGroup, "an int >= 0 or None");
  out->group_idx = group.u;
  const Value medium = value(kFMedium);
  if (medium.type != Value::kNil && medium.type != Value::kStr) throw bad(kFMedium, "a str or None");
  if (medium.type == Value::kStr) out->medium = std::string(medium.Str());
  if (out->type != RouterEvent::kStored) return;
  const Value size = value(kFBlockSize);
  if (size.type != Value::kUInt || size.u < 1) throw bad(kFBlockSize, "an int >= 1");
  out->block_size = size.u;
  const Value spec = value(kFSpecKind);
  if (spec.type != Value::kNil && spec.type != Value::kStr) throw bad(kFSpecKind, "a str or None");
  if (spec.type == Value::kStr) out->spec_kind = std::string(spec.Str());
  if (out->spec_kind == "sliding_window") {
    const Value w = value(kFWindow);
    if (w.type != Value::kUInt || w.u < 1) throw bad(kFWindow, "an int >= 1 for a sliding window");
    out->sliding_window = w.u;
  }
  const Value lora = value(kFLoraId);
  if (lora.type != Value::kNil && !lora.IsInt()) throw bad(kFLoraId, "an int or None");
  if (lora.IsInt()) {
    out->has_lora_id = true;
    out->lora_id_unsigned = lora.type == Value::kUInt && lora.u > static_cast<std::uint64_t>(INT64_MAX);
    out->lora_id = lora.type == Value::kUInt ? static_cast<std::int64_t>(lora.u) : lora.i;
  }
  const Value name = value(kFLoraName);
  if (name.type != Value::kNil && name.type != Value::kStr) throw bad(kFLoraName, "a str or None");
  if (name.type == Value::kStr) out->lora_name = std::string(name.Str());
}

}  // namespace

std::vector<RouterEvent> DecodeRouterEventBatch(const char* data, std::size_t size) {
  // One pass: each event is read (its other fields skipped, every byte checked) as it comes.
  // A wrong field is reported only once the rest of the payload proved to be msgpack, as a
  // decoder that reads it whole first would: bad msgpack anywhere is "not a msgpack batch".
  const char* end = data + size;
  Cursor c(data, end);
  auto check_rest = [&](Cursor rest, std::uint64_t values) {
    for (std::uint64_t k = 0; k < values; ++k) rest.Skip();
    if (!rest.done()) NotMsgpack("trailing characters after the batch");
  };
  const Value top = c.Next();
  bool ok = top.type == Value::kArray && top.n >= 2;
  if (ok) {
    c.Skip();  // ts
    Cursor peek = c;
    ok = peek.Next().type == Value::kArray;
  }
  if (!ok) {
    check_rest(Cursor(data, end), 1);
    throw std::invalid_argument("not a KVEventBatch [ts, events, rank]: " + ReprAt(data, end));
  }
  const Value events = c.Next();
  std::vector<RouterEvent> out(events.n);
  for (std::uint32_t k = 0; k < events.n; ++k) {
    const Cursor start = c;
    try {
      ReadEvent(c, end, k, &out[k]);
    } catch (const std::invalid_argument&) {
      check_rest(start, static_cast<std::uint64_t>(events.n - k) + (top.n - 2));
      throw;
    }
  }
  check_rest(c, top.n - 2);
  return out;
}

}  // namespace kvcache
