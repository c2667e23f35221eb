#include "transport/rules.h"

#include <arpa/inet.h>

#include <cstring>

#include "common/error.h"
#include "transport/shm/shm_segment.h"
#include "transport/socket/socket_transport.h"
#include "transport/verbs/verbs_rules.h"

namespace railcc::transport::rules {

GdrAnswer decideGdr(const std::string& gpu, const std::string& nic, const std::string& path, const std::string& level,
                    bool dmabuf, bool peermem) {
  const verbs::GdrDecision d = verbs::decideGdr(verbs::GdrFacts{gpu, nic, path, level, dmabuf, peermem});
  GdrAnswer a;
  a.mode = d.mode == verbs::GdrMode::kDmabuf ? "dmabuf" : d.mode == verbs::GdrMode::kPeermem ? "peermem" : "staged";
  a.line = d.line;
  a.withinLevel = d.withinLevel;
  return a;
}

std::pair<int, std::string> pickGid(const std::vector<Gid>& table, const Config& cfg, const std::string& where) {
  std::vector<verbs::GidEntry> entries;
  for (const Gid& g : table) {
    RAILCC_CHECK_ARG(g.raw.size() == 16, "a GID is 16 bytes, got ", g.raw.size());
    verbs::GidEntry e;
    e.index = g.index;
    std::memcpy(e.raw, g.raw.data(), 16);
    e.roceVersion = g.roceVersion;
    e.netdev = g.netdev;
    entries.push_back(e);
  }
  std::string why;
  const int index = verbs::pickGid(entries, cfg, where, &why);
  return {index, why};
}

size_t verbsRingBytes(int64_t buffSize) { return verbs::ringBytes(buffSize); }
int64_t verbsMaxRingBytes() { return verbs::kMaxRingBytes; }
size_t verbsConnectionBytes(int64_t buffSize, bool rendezvous) { return verbs::connectionPinnedBytes(buffSize, rendezvous); }

bool matchInterface(const std::string& name, const std::string& spec) { return socket::matchSpec(name, spec); }

std::vector<std::pair<std::string, std::string>> chooseInterfaces(const std::vector<Addr>& addrs, const std::string& spec) {
  std::vector<socket::InterfaceAddr> in;
  for (const Addr& a : addrs) {
    socket::InterfaceAddr x;
    x.name = a.name;
    x.up = a.up;
    x.loopback = a.loopback;
    x.addr.sin_family = AF_INET;
    RAILCC_CHECK_ARG(inet_pton(AF_INET, a.ipv4.c_str(), &x.addr.sin_addr) == 1, "not an IPv4 address: ", a.ipv4);
    in.push_back(x);
  }
  std::vector<std::pair<std::string, std::string>> out;
  for (const socket::Interface& i : socket::chooseInterfaces(in, spec)) {
    char ip[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &i.addr.sin_addr, ip, sizeof(ip));
    out.push_back({i.name, ip});
  }
  return out;
}

size_t shmSegmentBytes(int nslots, size_t fifoBytes, size_t ringBytes) {
  return shm::Domain::segmentBytes(nslots, fifoBytes, ringBytes);
}

}  // namespace railcc::transport::rules
