// transport/host_shared.h over POSIX shared memory: a Segment of its own per region, named like
// the transport's (/railcc-<uid>-<pid>-<random>), so the sweep of stale names covers it too.
#include "transport/host_shared.h"

#include <unistd.h>

#include "common/error.h"
#include "transport/shm/shm_segment.h"

namespace railcc::transport {

namespace {

class ShmShared : public HostShared {
 public:
  explicit ShmShared(std::unique_ptr<shm::Segment> seg) : seg_(std::move(seg)) {}
  char* data() const override { return seg_->data(); }
  const std::string& name() const override { return seg_->name(); }
  void unlinkName() override { seg_->unlink(); }

 private:
  std::unique_ptr<shm::Segment> seg_;
};

}  // namespace

std::unique_ptr<HostShared> HostShared::create(size_t bytes) {
  const std::string name =
      "/railcc-" + std::to_string(getuid()) + "-" + std::to_string(getpid()) + "-" + shm::randomToken();
  auto seg = std::make_unique<shm::Segment>(name, bytes);
  seg->reserve(0, bytes);  // its pages exist now: peers write into them at any time
  return std::make_unique<ShmShared>(std::move(seg));
}

std::unique_ptr<HostShared> HostShared::open(const std::string& name, size_t bytes) {
  auto seg = std::make_unique<shm::Segment>(name, false);
  RAILCC_CHECK_ARG(seg->size() >= bytes, "shared memory ", name, " has ", seg->size(), " bytes, not the ", bytes,
                   " its peers lay out in it (ranks of different railcc builds?)");
  return std::make_unique<ShmShared>(std::move(seg));
}

}  // namespace railcc::transport
