#pragma once
// A small region of memory that the ranks of one host map by name: where the engine keeps
// tables its local peers read and write without a message (the registered segments' boards,
// engine/device/segments.h). Made zeroed by one rank, mapped by the others with the name it
// sends them; the maker lets go of the name once they all have. Shared memory provides it
// (transport/shm/host_shared.cpp); the engine sees only this contract.

#include <cstddef>
#include <memory>
#include <string>

namespace railcc::transport {

class HostShared {
 public:
  virtual ~HostShared() = default;
  /// `bytes` of zeroed memory with a fresh name. Throws kSystem naming what failed.
  static std::unique_ptr<HostShared> create(size_t bytes);
  /// Maps the region a peer made. Throws kSystem naming it when it cannot, or kInvalidUsage
  /// when it is smaller than `bytes`.
  static std::unique_ptr<HostShared> open(const std::string& name, size_t bytes);

  virtual char* data() const = 0;
  virtual const std::string& name() const = 0;
  /// The maker's: every peer has mapped it, so its name can go (the memory stays while mapped).
  virtual void unlinkName() = 0;
};

}  // namespace railcc::transport
