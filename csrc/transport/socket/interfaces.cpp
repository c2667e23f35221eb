// Which network interfaces the socket transport uses: RAILCC_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
// matching and the choice among the machine's IPv4 addresses.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/error.h"
#include "transport/socket/socket_transport.h"

namespace railcc::transport::socket {

bool matchSpec(const std::string& name, const std::string& spec) {
  std::string s = spec;
  bool exclude = false, exact = false;
  if (!s.empty() && s[0] == '^') {
    exclude = true;
    s = s.substr(1);
  }
  if (!s.empty() && s[0] == '=') {
    exact = true;
    s = s.substr(1);
  }
  bool hit = false;
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (!tok.empty()) {
      if (exact ? name == tok : name.compare(0, tok.size(), tok) == 0) hit = true;
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return exclude ? !hit : hit;
}

std::string formatAddr(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
}

std::vector<Interface> chooseInterfaces(const std::vector<InterfaceAddr>& addrs, const std::string& spec) {
  std::vector<Interface> chosen;
  Interface loopback;
  for (const InterfaceAddr& i : addrs) {
    if (!i.up) continue;
    bool ok = spec.empty() ? matchSpec(i.name, "^docker,lo") : matchSpec(i.name, spec);
    // Without a spec, the first match only; with one, every match (one address per name).
    bool dup = std::any_of(chosen.begin(), chosen.end(), [&](const Interface& c) { return c.name == i.name; });
    if (ok && !dup && (chosen.empty() || !spec.empty())) chosen.push_back({i.name, i.addr});
    if (i.loopback && loopback.name.empty()) loopback = {i.name, i.addr};
  }
  // A machine with no network at all: every peer is local, loopback is right.
  if (chosen.empty() && spec.empty() && !loopback.name.empty()) chosen.push_back(loopback);
  for (auto& c : chosen) c.addr.sin_port = 0;
  return chosen;
}

std::vector<Interface> pickInterfaces(const std::string& spec) {
  std::vector<InterfaceAddr> addrs = listInterfaces();
  std::vector<std::string> seen;
  for (const InterfaceAddr& a : addrs)
    if (a.up) seen.push_back(a.name);
  std::vector<Interface> chosen = chooseInterfaces(addrs, spec);
  if (chosen.empty()) {
    std::string all;
    for (auto& s : seen) all += (all.empty() ? "" : ", ") + s;
    RAILCC_THROW(kInvalidUsage, "RAILCC_SOCKET_IFNAME/NCCL_SOCKET_IFNAME='", spec,
                 "' matches no up IPv4 interface; interfaces here: ", all);
  }
  return chosen;
}

std::string pickInterface(const std::string& spec, sockaddr_in& addr) {
  Interface first = pickInterfaces(spec).front();
  addr = first.addr;
  return first.name;
}

}  // namespace railcc::transport::socket
