#pragma once
// Tensor memory as the transports that register it with a NIC need to know it
// (transport/memory_owners.h): whose allocation an address belongs to, and until when. The .cpp
// also holds the backend's allocate_tensor: host tensors from the allocator below, CUDA ones
// from the group's heap (engine/device/heap.h).
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <memory>
#include <vector>

namespace railcc {

/// Notes the owner of each large CPU tensor's allocation before the engine sees its address.
/// An allocation of the CPU allocator is watched through its deleter, swapped for one that
/// marks it freed first: a registration of it is then kept exactly until it is freed (a storage
/// destroyed, or resized to 0 and back as FSDP does). Others get no owner.
void noteTensorOwners(const std::vector<at::Tensor>& tensors);

/// Page-aligned host memory whose owner is noted from the start (Backend::getMemAllocator,
/// allocate_tensor): a transport registers it once, at its first message.
class CommunicationAllocator : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
};
std::shared_ptr<c10::Allocator> communicationAllocator();

}  // namespace railcc
