#pragma once
// The transports' host rules, as pure functions of plain facts: what `railcc doctor` asks the
// C++ the transports run (through railcc._C.rules), so that a rule has one source. Part of the
// transport contract: the glue reaches every transport's rules through this header, never
// through a transport's own folder; each rule's body is that transport's (rules.cpp forwards).
// None blocks; all are thread-safe.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"

namespace railcc::transport::rules {

/// verbs: the GPUDirect RDMA decision for one GPU and NIC (`path`: LOC, PIX, PXB, PHB, SYS or
/// "" unknown; `level`: RAILCC_NET_GDR_LEVEL). `mode`: "dmabuf", "peermem" or "staged".
struct GdrAnswer {
  std::string mode, line;
  bool withinLevel = false;
};
GdrAnswer decideGdr(const std::string& gpu, const std::string& nic, const std::string& path, const std::string& level,
                    bool dmabuf, bool peermem);

/// verbs: which RoCE GID a port uses, from its table, under `cfg`'s GID settings: the index
/// (or -1) and why. Each entry's raw GID is 16 bytes; another length throws kInvalidUsage.
struct Gid {
  int index = 0;
  std::string raw;      // 16 bytes
  int roceVersion = 0;  // 1, 2, or 0 when the kernel does not say
  std::string netdev;
};
std::pair<int, std::string> pickGid(const std::vector<Gid>& table, const Config& cfg, const std::string& where);

/// verbs: bytes of a connection's receive ring for RAILCC_BUFFSIZE, the most a ring may have,
/// and what a connection pins (ring, staging, and with rendezvous its bounce buffer).
size_t verbsRingBytes(int64_t buffSize);
int64_t verbsMaxRingBytes();
size_t verbsConnectionBytes(int64_t buffSize, bool rendezvous);

/// socket: whether RAILCC_SOCKET_IFNAME `spec` takes interface `name`; and the interfaces the
/// transport takes from getifaddrs' list (name, up, loopback, IPv4 text) as (name, IPv4).
/// An address that is not IPv4 text throws kInvalidUsage.
struct Addr {
  std::string name;
  bool up = false, loopback = false;
  std::string ipv4;
};
bool matchInterface(const std::string& name, const std::string& spec);
std::vector<std::pair<std::string, std::string>> chooseInterfaces(const std::vector<Addr>& addrs, const std::string& spec);

/// shm: bytes of one rank's segment: `nslots` FIFOs (local ranks x lanes) and a broadcast ring.
size_t shmSegmentBytes(int nslots, size_t fifoBytes, size_t ringBytes);

}  // namespace railcc::transport::rules
