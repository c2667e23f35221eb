#pragma once
// The scale simulation: what the engine's schedules would do in a job of any size, without
// running it. For a job of `size` ranks, `perHost` to a host (ranks numbered host by host, as
// torchrun places them), it asks the engine's own rule (chooseAlgo) which algorithm an op
// runs, builds every rank's steps from the engine's own step functions
// (algorithms/schedule.h), and plays them against each other: a step ends one unit after the
// later of its own start and the starts of the steps whose messages it receives (messages
// between a pair in order). Nothing is moved or allocated per byte, so 4,096 ranks take
// seconds. What it does not model: time per byte, channels splitting a message, the
// shared-memory broadcast rings of a one-host group (not simulated: an error says so).
// Read by `python -m railcc sim` (python/railcc/sim.py), checked against real ranks' traffic
// by tests/python/test_scale_sim.py.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace railcc::engine {

struct SimJob {
  int size = 1;
  int perHost = 1;              // ranks per host; size must be a multiple of it
  int64_t oneshotBytes = 65536; // RAILCC_ONESHOT_BYTES
  std::string algo;             // RAILCC_ALGO
};

struct SimResult {
  std::string algo;             // what the rule chose, and hier's stage between hosts
  int steps = 0;                // the critical path, in steps
  // Per rank, the largest over ranks:
  int netPeers = 0;             // peers on other hosts it exchanged messages with
  int localPeers = 0;           // peers on its host
  uint64_t messages = 0;        // messages it sent
  uint64_t bytesSent = 0;       // payload bytes it sent
  uint64_t netBytesSent = 0;    // of them to other hosts
  // With `perRank`: for every rank, {peer, bytes sent} for each peer it sent bytes to.
  std::vector<std::vector<std::pair<int, uint64_t>>> sent;
};

/// Simulates one op ("all_reduce", "reduce_scatter", "all_gather", "broadcast"; broadcast from
/// rank 0) of `bytes` bytes per rank (for reduce_scatter and all_gather, the bytes of one
/// rank's block, as c10d counts them) with elements of `elemSize` bytes. Throws
/// kInvalidUsage for a job or op it cannot simulate.
SimResult simulateOp(const SimJob& job, const std::string& op, size_t bytes, size_t elemSize, bool perRank);

/// Store reads at set-up, the most over ranks, through set-up's own pieces (engine/records.h):
/// the host map combined in groups as set-up combines it (records.h) and encoded as set-up does (host ids of
/// `idBytes` characters, hostnames of `nameBytes`), plus this host's records and endpoints of
/// `recordBytes` and `endpointBytes` each, and the 64-byte secret with rank 0's algorithm settings.
struct SimSetup {
  int keys = 0;        // keys read
  uint64_t bytes = 0;  // bytes read
  int reads = 0;       // store calls that read (each batched)
  int writes = 0;      // keys set and counts added (a rank that completes a group at every level)
};
SimSetup simulateSetup(const SimJob& job, int idBytes, int nameBytes, uint64_t recordBytes, uint64_t endpointBytes);

}  // namespace railcc::engine
