#include "transport/verbs/verbs_rules.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace railcc::transport::verbs {

// --- HCA filter ---------------------------------------------------------------------------

HcaFilter parseHcaSpec(const std::string& spec) {
  HcaFilter f;
  std::string s = spec;
  if (!s.empty() && s[0] == '^') {
    f.exclude = true;
    s = s.substr(1);
  }
  if (!s.empty() && s[0] == '=') {
    f.exact = true;
    s = s.substr(1);
  }
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!tok.empty()) {
      int port = -1;
      size_t colon = tok.find(':');
      if (colon != std::string::npos) {
        port = std::atoi(tok.c_str() + colon + 1);
        tok = tok.substr(0, colon);
      }
      f.items.push_back({tok, port});
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return f;
}

bool hcaMatches(const HcaFilter& f, const std::string& dev, int port) {
  if (f.items.empty()) return true;
  bool hit = false;
  for (auto& [name, p] : f.items) {
    bool nameOk = f.exact ? dev == name : dev.compare(0, name.size(), name) == 0;
    if (nameOk && (p < 0 || p == port)) hit = true;
  }
  return f.exclude ? !hit : hit;
}

// --- GIDs ----------------------------------------------------------------------------------

std::string formatGid(const uint8_t raw[16]) {
  char buf[INET6_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET6, raw, buf, sizeof(buf));
  return buf;
}

bool gidIsZero(const uint8_t raw[16]) {
  for (int i = 0; i < 16; ++i)
    if (raw[i]) return false;
  return true;
}

bool gidIsLinkLocal(const uint8_t raw[16]) { return raw[0] == 0xfe && (raw[1] & 0xc0) == 0x80; }

bool gidIsIpv4Mapped(const uint8_t raw[16]) {
  for (int i = 0; i < 10; ++i)
    if (raw[i]) return false;
  return raw[10] == 0xff && raw[11] == 0xff;
}

namespace {

// "10.77.0.0/16" contains the IPv4-mapped GID? An unparsable range contains nothing.
bool inRange(const uint8_t raw[16], const std::string& range) {
  if (range.empty()) return true;
  if (!gidIsIpv4Mapped(raw)) return false;
  size_t slash = range.find('/');
  in_addr net{};
  if (inet_pton(AF_INET, range.substr(0, slash).c_str(), &net) != 1) return false;
  int bits = slash == std::string::npos ? 32 : std::atoi(range.c_str() + slash + 1);
  if (bits < 0 || bits > 32) return false;
  uint32_t mask = bits == 0 ? 0 : htonl(~uint32_t(0) << (32 - bits));
  uint32_t a;
  memcpy(&a, raw + 12, 4);
  return (a & mask) == (net.s_addr & mask);
}

std::string describeEntry(const GidEntry& e) {
  return std::to_string(e.index) + " " + formatGid(e.raw) +
         (e.roceVersion ? " RoCE v" + std::to_string(e.roceVersion) : std::string()) +
         (e.netdev.empty() ? std::string() : " on " + e.netdev);
}

}  // namespace

int pickGid(const std::vector<GidEntry>& table, const Config& cfg, const std::string& where, std::string* why) {
  auto listing = [&] {
    std::string s;
    for (const GidEntry& e : table)
      if (!gidIsZero(e.raw)) s += "\n  " + describeEntry(e);
    return s.empty() ? std::string("\n  (no GID at all: the port's interface has no address)") : s;
  };
  bool v4 = cfg.ibAddrFamily != "AF_INET6";
  auto wanted = [&](const GidEntry& e) {
    return !gidIsZero(e.raw) && !gidIsLinkLocal(e.raw) && gidIsIpv4Mapped(e.raw) == v4 &&
           (e.roceVersion == 0 || e.roceVersion == cfg.ibRoceVersion) && inRange(e.raw, cfg.ibAddrRange);
  };
  int best = -1;
  for (const GidEntry& e : table)
    if (wanted(e)) {
      best = e.index;
      break;
    }
  if (cfg.ibGidIndex >= 0) {
    for (const GidEntry& e : table) {
      if (e.index != cfg.ibGidIndex || gidIsZero(e.raw)) continue;
      *why = "GID index " + std::to_string(e.index) + " forced by RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX";
      if (gidIsLinkLocal(e.raw) || (e.roceVersion && e.roceVersion != cfg.ibRoceVersion))
        *why += std::string("; it is ") + (gidIsLinkLocal(e.raw) ? "link-local" : "not RoCE v" + std::to_string(cfg.ibRoceVersion)) +
                ", so traffic may not route" + (best >= 0 ? " (index " + std::to_string(best) + " would)" : "");
      return e.index;
    }
    *why = where + " has no GID at index " + std::to_string(cfg.ibGidIndex) + " (RAILCC_IB_GID_INDEX/NCCL_IB_GID_INDEX=" +
           std::to_string(cfg.ibGidIndex) + "); its table:" + listing() +
           (best >= 0 ? "\nset it to " + std::to_string(best) + ", or unset it to pick automatically" : "");
    return -1;
  }
  if (best >= 0) {
    *why = "GID index " + std::to_string(best) + " picked: RoCE v" + std::to_string(cfg.ibRoceVersion) + ", " +
           (v4 ? "IPv4" : "IPv6") + (cfg.ibAddrRange.empty() ? "" : " inside " + cfg.ibAddrRange) + ", not link-local";
    return best;
  }
  *why = where + " has no RoCE v" + std::to_string(cfg.ibRoceVersion) + " " + (v4 ? "IPv4" : "IPv6") + " GID" +
         (cfg.ibAddrRange.empty() ? "" : " inside RAILCC_IB_ADDR_RANGE=" + cfg.ibAddrRange) + "; its table:" + listing() +
         "\ngive its interface an address (ip addr add ADDR/PREFIX dev NETDEV), or force one with RAILCC_IB_GID_INDEX";
  return -1;
}

// --- GPUDirect RDMA ------------------------------------------------------------------------

namespace {

int pathRank(const std::string& p) {
  static const char* order[] = {"LOC", "PIX", "PXB", "PHB", "SYS"};
  for (int i = 0; i < 5; ++i)
    if (p == order[i]) return i;
  return -1;
}

int levelRank(const std::string& level) {
  // NCCL's old numeric levels: 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and 5 SYS.
  if (level.size() == 1 && level[0] >= '0' && level[0] <= '5') return std::min(level[0] - '0', 4);
  int r = pathRank(level);
  return r < 0 ? pathRank("PXB") : r;
}

}  // namespace

GdrDecision decideGdr(const GdrFacts& f) {
  GdrDecision d;
  std::string pair = f.gpu + " <-> " + f.nic;
  std::string staged = ": staging through host memory";
  int path = pathRank(f.path);
  if (path < 0) {
    d.line = "GPUDirect RDMA disabled for " + pair + ": the PCI path between them is unknown (no topology)" + staged;
    return d;
  }
  if (path > levelRank(f.level)) {
    d.line = "GPUDirect RDMA disabled for " + pair + ": their path is " + f.path + ", beyond RAILCC_NET_GDR_LEVEL/NCCL_NET_GDR_LEVEL=" +
             f.level + staged;
    return d;
  }
  d.withinLevel = true;
  if (f.dmabuf) {
    d.mode = GdrMode::kDmabuf;
    d.line = "GPUDirect RDMA enabled for " + pair + " (dma-buf, path " + f.path + ")";
  } else if (f.peermem) {
    d.mode = GdrMode::kPeermem;
    d.line = "GPUDirect RDMA enabled for " + pair + " (nvidia_peermem, path " + f.path + ")";
  } else {
    d.line = "GPUDirect RDMA disabled for " + pair + ": nvidia_peermem not loaded and dma-buf unsupported" + staged;
  }
  return d;
}

// --- Memory ---------------------------------------------------------------------------------

size_t ringBytes(int64_t buffSize) { return static_cast<size_t>(std::min<int64_t>(buffSize, kMaxRingBytes)); }

size_t connectionPinnedBytes(int64_t buffSize, bool rendezvous) {
  return 2 * ringBytes(buffSize) + (rendezvous ? kRndvBounceBytes : 0);
}

}  // namespace railcc::transport::verbs
