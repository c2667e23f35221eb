// The device layer's side of registered segments (segments.h): the boards made and mapped at
// the CUDA IPC set-up, and where an op's buffer outside the heap is found by its peers.
#include <cstring>

#include "common/log.h"
#include "engine/allocator_segments.h"
#include "engine/device/device_layer.h"

namespace railcc::engine {

void DeviceLayer::segsExport(char* blob, std::string* why) {
  std::memset(blob, 0, kBoardBlob);
  try {
    dev_.shot.board = transport::HostShared::create(sizeof(SegmentBoard));
  } catch (const std::exception& e) {
    *why = std::string("no shared memory for the registered segments' board: ") + e.what();
    return;
  }
  const std::string& name = dev_.shot.board->name();
  if (name.size() >= kBoardBlob) {
    *why = "the board's name " + name + " is too long";
    return;
  }
  std::memcpy(blob, name.data(), name.size());
}

void DeviceLayer::segsOpen(size_t q, const char* blob, std::string* why) {
  dev_.shot.boards.resize(static_cast<size_t>(size_));
  const std::string name(blob, strnlen(blob, kBoardBlob));
  if (name.empty()) {
    if (why->empty()) *why = ch_.rankName(static_cast<int>(q)) + " has no board for registered segments";
    return;
  }
  try {
    dev_.shot.boards[q] = transport::HostShared::open(name, sizeof(SegmentBoard));
  } catch (const std::exception& e) {
    if (why->empty()) *why = "cannot map " + ch_.rankName(static_cast<int>(q)) + "'s board: " + e.what();
  }
}

bool DeviceLayer::segsStart(const cuda::DeviceApi& api, int device, std::string* why) {
  ShotState& s = dev_.shot;
  const size_t n = static_cast<size_t>(size_), cells = n * cuda::kSegSlots;
  void* p = nullptr;
  if (api.hostAlloc(&p, cells * sizeof(char*)) != 0) {
    *why = "cudaHostAlloc (the registered segments' table) failed";
    return false;
  }
  s.segTable = static_cast<char**>(p);
  std::memset(s.segTable, 0, cells * sizeof(char*));
  std::vector<SegmentBoard*> boards(n, nullptr);
  std::vector<std::shared_ptr<transport::HostShared>> held;
  for (size_t q = 0; q < n; ++q) {
    std::shared_ptr<transport::HostShared> b = q == static_cast<size_t>(rank_) ? s.board : s.boards[q];
    if (!b) {
      *why = "a board of registered segments is missing";
      return false;
    }
    boards[q] = reinterpret_cast<SegmentBoard*>(b->data());
    held.push_back(std::move(b));
  }
  // Ten seconds at most for peers to close a segment before it is freed: their watchers answer
  // at once unless stopped.
  const auto wait = std::min<std::chrono::milliseconds>(opts_.timeout, std::chrono::milliseconds(10000));
  // Names of the ranks, copied: the registry may outlive this layer on a thread that frees memory.
  std::vector<std::string> names;
  for (int q = 0; q < size_; ++q) names.push_back(ch_.rankName(q));
  const cuda::DeviceApi* a = &api;
  char** table = s.segTable;
  s.segs = std::make_shared<SegmentRegistry>(
      api, rank_, std::move(boards), table, device, wait, [names](int q) { return names[static_cast<size_t>(q)]; },
      [a, table, held = std::move(held)]() mutable {
        a->hostFree(table);
        held.clear();
      });
  s.segTable = nullptr;  // the registry's now
  s.segTableInUse = table;
  return true;
}

void DeviceLayer::segsGo() {
  ShotState& s = dev_.shot;
  if (!s.segs) return;
  s.board->unlinkName();  // every peer mapped it before the vote
  s.segs->startWatcher();
  enlistSegments(s.segs);
}

void DeviceLayer::segsRelease(const cuda::DeviceApi& api) {
  ShotState& s = dev_.shot;
  if (s.segs) s.segs->shutdown();  // peers closed ours (or are gone), ours of theirs closed
  s.segs.reset();                  // the table and boards go with the registry's last holder
  if (s.segTable) api.hostFree(s.segTable);  // made, but set-up failed before a registry had it
  s.segTable = nullptr;
  s.segTableInUse = nullptr;
  s.boards.clear();
  s.board.reset();
}

uint64_t DeviceLayer::segPlace(const void* p, size_t bytes) {
  SegmentRegistry* r = dev_.shot.segs.get();
  if (!r || dev_.capturing || bytes == 0) return cuda::kInScratch;
  const uint64_t at = r->place(p, bytes);
  if (at != cuda::kInScratch) return at;
  // Not registered yet: offer its segment now (a block of torch's caching allocator, whose
  // freeing the allocator tells us first), and this op goes through the scratch.
  char* base = nullptr;
  size_t size = 0;
  if (!r->offered(p) && findSegment(p, &base, &size) && cuda::shotOffsetIn(base, size, p, bytes) != cuda::kInScratch)
    r->offer(base, size);
  return cuda::kInScratch;
}

}  // namespace railcc::engine
