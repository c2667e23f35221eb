// The topology as a few lines of text, for the per-machine cache in shared.cpp: ranks that
// start together read what the first one discovered without loading hwloc at all (hwloc's
// init and its plugins cost 1.4-2.3 ms of CPU per process here, 64 ranks on 2 cores ~70 ms of
// wall time at set-up; this parse costs microseconds). One line per item, fields separated by
// spaces, "-" for an empty field, lists joined by commas:
//
//   railcc-topology 1
//   numa <nodes>
//   gpu <found 0|1> <pci>
//   nic <name> <rdma 0|1> <netdevs> <pci>
//   xml <bytes>              (then the hwloc XML itself, what RAILCC_TOPO_DUMP_FILE writes)
//
// where <pci> is "<bus id> <numa> <link GB/s> <host bridge> <bridges>". Names and bus ids
// never hold spaces or commas (interface and device names cannot); one that did is refused
// when written, and a file that does not parse is not used.
#include <cstdlib>
#include <sstream>

#include "topology/topology.h"

namespace railcc::topology {

namespace {

constexpr const char* kMagic = "railcc-topology 1";

// A name a field can hold as it is: not empty, no separator, not the mark of an empty field.
bool plain(const std::string& s) { return !s.empty() && s.find_first_of(" ,\n\r\t") == std::string::npos && s != "-"; }

std::string field(const std::string& s) { return s.empty() ? "-" : s; }

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ",") + s;
  return field(out);
}

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  if (s == "-") return out;
  std::istringstream is(s);
  for (std::string item; std::getline(is, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

bool encodePci(const PciDevice& p, std::ostream& os) {
  if (!(p.busId.empty() || plain(p.busId)) || !(p.root.empty() || plain(p.root))) return false;
  for (const std::string& b : p.chain)
    if (!plain(b)) return false;
  os << field(p.busId) << ' ' << p.numa << ' ' << p.linkGBs << ' ' << field(p.root) << ' ' << joined(p.chain);
  return true;
}

bool decodePci(std::istream& is, PciDevice& p) {
  std::string bus, root, chain;
  if (!(is >> bus >> p.numa >> p.linkGBs >> root >> chain)) return false;
  p.busId = bus == "-" ? "" : bus;
  p.root = root == "-" ? "" : root;
  p.chain = splitList(chain);
  return true;
}

}  // namespace

std::string encodeCompact(const Topology& t) {
  std::ostringstream os;
  os.precision(17);
  os << kMagic << "\nnuma " << t.numaNodes << "\n";
  for (const Gpu& g : t.gpus) {
    os << "gpu " << (g.found ? 1 : 0) << ' ';
    if (!encodePci(g.pci, os)) return "";
    os << '\n';
  }
  for (const Nic& n : t.nics) {
    if (!plain(n.name)) return "";
    for (const std::string& d : n.netdevs)
      if (!plain(d)) return "";
    os << "nic " << n.name << ' ' << (n.rdma ? 1 : 0) << ' ' << joined(n.netdevs) << ' ';
    if (!encodePci(n.pci, os)) return "";
    os << '\n';
  }
  os << "xml " << t.xml.size() << '\n' << t.xml;
  return os.str();
}

bool decodeCompact(const std::string& text, Topology& out) {
  std::istringstream is(text);
  std::string line;
  if (!std::getline(is, line) || line != kMagic) return false;
  Topology t;
  bool numa = false;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string kind;
    ls >> kind;
    if (kind == "numa") {
      numa = static_cast<bool>(ls >> t.numaNodes) && t.numaNodes >= 1;
      if (!numa) return false;
    } else if (kind == "gpu") {
      Gpu g;
      int found = 0;
      if (!(ls >> found) || !decodePci(ls, g.pci)) return false;
      g.found = found != 0;
      t.gpus.push_back(g);
    } else if (kind == "nic") {
      Nic n;
      int rdma = 0;
      std::string netdevs;
      if (!(ls >> n.name >> rdma >> netdevs) || !decodePci(ls, n.pci)) return false;
      n.rdma = rdma != 0;
      n.netdevs = splitList(netdevs);
      t.nics.push_back(n);
    } else if (kind == "xml") {
      size_t bytes = 0;
      if (!(ls >> bytes)) return false;
      const size_t at = static_cast<size_t>(is.tellg());
      if (is.tellg() < 0 || at + bytes != text.size()) return false;
      t.xml = text.substr(at);
      if (!numa) return false;
      out = std::move(t);
      return true;
    } else {
      return false;
    }
    std::string rest;
    if (ls >> rest) return false;  // a field more than this version writes
  }
  return false;  // no xml line: cut short
}

}  // namespace railcc::topology
