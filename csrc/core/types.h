// Vocabulary of the gemini_ext core (torch-free, CUDA-free).
//
// Glossary
//  * element / numel: one scalar of a tensor; sizes in elements are named `*_numel`.
//  * bytes: sizes in bytes are named `*_bytes`.
//  * slot (tensor slot): where one tensor lives inside a chunk: offset and numel in elements.
//  * chunk: a flat buffer of one dtype holding several tensors back to back, padded so that it
//    splits into `world_size` equal shards.
//  * shard: the part of a chunk a rank owns between uses; with world_size 1 it is the chunk.
//  * gathered: the whole chunk is present on the device (all shards), as compute needs it.
//  * tier: a kind of memory a shard can live in: the device (GPU or the simulated device),
//    pinned host memory, pageable host memory.
//  * pool slot: a fixed-size block of a tier's memory from the chunk pool; one per chunk copy.
//  * group: a named family of chunks with one dtype and one chunk size ("param", "master"...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gx {

using ChunkId = int64_t;

enum class DType : int8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt64 = 4,
  kInt32 = 5,
  kUInt8 = 6
};

size_t element_size_bytes(DType dtype);
const char* to_string(DType dtype);
DType dtype_from_string(const std::string& name);  // "float32", "bfloat16", ...

enum class Tier : int8_t { kDevice = 0, kPinnedHost = 1, kPageableHost = 2 };
constexpr int kNumTiers = 3;

const char* to_string(Tier tier);
inline bool is_host(Tier tier) { return tier != Tier::kDevice; }

// A set of tiers as a bit mask (a shard may be present in several tiers at once).
class TierSet {
 public:
  bool contains(Tier t) const { return bits_ & bit(t); }
  void add(Tier t) { bits_ |= bit(t); }
  void remove(Tier t) { bits_ &= static_cast<uint8_t>(~bit(t)); }
  bool empty() const { return bits_ == 0; }
  std::string to_string() const;

 private:
  static uint8_t bit(Tier t) { return static_cast<uint8_t>(1u << static_cast<int>(t)); }
  uint8_t bits_ = 0;
};

inline size_t round_up(size_t value, size_t multiple) {
  return multiple == 0 ? value : (value + multiple - 1) / multiple * multiple;
}

}  // namespace gx
