// railcc._C.rules: the engine's and the transports' host rules as pure functions, for
// `railcc doctor` (python/railcc/doctor). The doctor reads a host's facts itself (sysfs,
// procfs) and asks these functions what railcc would decide from them, so a rule has one
// source: the C++ the engine runs. Each binding only converts arguments and results.
#include "rules_module.h"

#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/config.h"
#include "common/error.h"
#include "engine/simulate.h"
#include "topology/topology.h"
#include "transport/rules.h"

namespace py = pybind11;

namespace {

namespace topo = railcc::topology;
namespace rules = railcc::transport::rules;

// (bus id, NUMA node, bridges from the root port down, host bridge): what the doctor's
// System reads for a PCI device, and what topology::PciDevice holds.
using PciTuple = std::tuple<std::string, int, std::vector<std::string>, std::string>;

topo::PciDevice toPci(const PciTuple& t) {
  topo::PciDevice d;
  d.busId = std::get<0>(t);
  d.numa = std::get<1>(t);
  d.chain = std::get<2>(t);
  d.root = std::get<3>(t);
  return d;
}

}  // namespace

void registerRules(py::module_& parent) {
  py::module_ m = parent.def_submodule("rules", "railcc's host rules (the C++ the engine runs), for railcc doctor");

  m.def("path_between", [](const PciTuple& a, const PciTuple& b) {
    return std::string(topo::pathName(topo::pathBetween(toPci(a), toPci(b))));
  }, py::arg("a"), py::arg("b"),
        "PCI path type (LOC, PIX, PXB, PHB, SYS) between two devices, each (bus_id, numa, chain, root)");

  m.def("parse_path", [](const std::string& s) {
    try {
      return std::string(topo::pathName(topo::parsePath(s)));
    } catch (const railcc::Error& e) {
      throw py::value_error(e.what());
    }
  }, py::arg("level"), "A path type or NCCL_NET_GDR_LEVEL value (PIX, pxb, 2, ...) as its name; ValueError otherwise");

  m.def("decide_gdr", [](const std::string& gpu, const std::string& nic, const std::string& path,
                         const std::string& level, bool dmabuf, bool peermem) {
    const rules::GdrAnswer a = rules::decideGdr(gpu, nic, path, level, dmabuf, peermem);
    py::dict out;
    out["mode"] = a.mode;
    out["within_level"] = a.withinLevel;
    out["line"] = a.line;
    return out;
  }, py::arg("gpu"), py::arg("nic"), py::arg("path"), py::arg("level"), py::arg("dmabuf"), py::arg("peermem"),
        "The verbs transport's GPUDirect RDMA decision: {mode: dmabuf|peermem|staged, within_level, line}");

  m.def("pick_gid", [](const std::vector<std::tuple<int, py::bytes, int, std::string>>& table, int64_t gidIndex,
                       int64_t roceVersion, const std::string& addrFamily, const std::string& addrRange,
                       const std::string& where) {
    std::vector<rules::Gid> entries;
    for (const auto& [index, raw, version, netdev] : table) entries.push_back({index, std::string(raw), version, netdev});
    railcc::Config cfg = railcc::Config::defaults();
    cfg.ibGidIndex = gidIndex;
    cfg.ibRoceVersion = roceVersion;
    cfg.ibAddrFamily = addrFamily;
    cfg.ibAddrRange = addrRange;
    try {
      return rules::pickGid(entries, cfg, where);
    } catch (const railcc::Error& e) {
      throw py::value_error(e.what());
    }
  }, py::arg("table"), py::arg("gid_index") = -1, py::arg("roce_version") = 2, py::arg("addr_family") = "AF_INET",
        py::arg("addr_range") = "", py::arg("where") = "the port",
        "The RoCE GID a port uses, from its table [(index, raw 16 bytes, RoCE version 0|1|2, netdev)]: (index or -1, why)");

  m.def("match_spec", &rules::matchInterface, py::arg("name"), py::arg("spec"),
        "Whether RAILCC_SOCKET_IFNAME / NCCL_SOCKET_IFNAME `spec` takes interface `name`");

  m.def("choose_interfaces", [](const std::vector<std::tuple<std::string, bool, bool, std::string>>& addrs,
                                const std::string& spec) {
    std::vector<rules::Addr> in;
    for (const auto& [name, up, loopback, ip] : addrs) in.push_back({name, up, loopback, ip});
    try {
      return rules::chooseInterfaces(in, spec);
    } catch (const railcc::Error& e) {
      throw py::value_error(e.what());
    }
  }, py::arg("addrs"), py::arg("spec"),
        "The socket transport's interfaces from [(name, up, loopback, ipv4)] in getifaddrs order: [(name, ipv4)]");

  m.def("shm_segment_bytes", &rules::shmSegmentBytes, py::arg("nslots"), py::arg("fifo_bytes"), py::arg("ring_bytes"),
        "Bytes of one rank's shared-memory segment: nslots FIFOs (local ranks x lanes) and a broadcast ring");

  m.def("verbs_ring_bytes", &rules::verbsRingBytes, py::arg("buffsize"),
        "Bytes of a verbs connection's receive ring (and of its send staging area) for RAILCC_BUFFSIZE");
  m.def("verbs_connection_bytes", &rules::verbsConnectionBytes, py::arg("buffsize"), py::arg("rendezvous") = false,
        "Bytes a verbs connection pins (its ring and its staging area, and with rendezvous its bounce buffer) "
        "for RAILCC_BUFFSIZE");
  m.attr("VERBS_MAX_RING_BYTES") = rules::verbsMaxRingBytes();

  m.def("simulate", [](int size, int perHost, const std::string& op, size_t bytes, size_t elemSize,
                       int64_t oneshotBytes, const std::string& algo, bool perRank) {
    railcc::engine::SimJob job;
    job.size = size;
    job.perHost = perHost;
    job.oneshotBytes = oneshotBytes;
    job.algo = algo;
    railcc::engine::SimResult r;
    {
      py::gil_scoped_release nogil;
      r = railcc::engine::simulateOp(job, op, bytes, elemSize, perRank);
    }
    py::dict d;
    d["algo"] = r.algo;
    d["steps"] = r.steps;
    d["net_peers"] = r.netPeers;
    d["local_peers"] = r.localPeers;
    d["messages"] = r.messages;
    d["bytes_sent"] = r.bytesSent;
    d["net_bytes_sent"] = r.netBytesSent;
    if (perRank) d["sent"] = r.sent;
    return d;
  }, py::arg("size"), py::arg("per_host"), py::arg("op"), py::arg("bytes"), py::arg("elem_size") = 4,
        py::arg("oneshot_bytes") = 65536, py::arg("algo") = "", py::arg("per_rank") = false,
        "The scale simulation of one op (engine/simulate.h): the algorithm the rule picks, the critical path in "
        "steps, and per rank (the largest over ranks) peers, messages and bytes sent; with per_rank, every "
        "rank's [(peer, bytes sent)]");
  m.def("simulate_setup", [](int size, int perHost, int idBytes, int nameBytes, uint64_t recordBytes,
                             uint64_t endpointBytes) {
    railcc::engine::SimJob job;
    job.size = size;
    job.perHost = perHost;
    railcc::engine::SimSetup r;
    {
      py::gil_scoped_release nogil;
      r = railcc::engine::simulateSetup(job, idBytes, nameBytes, recordBytes, endpointBytes);
    }
    py::dict d;
    d["store_keys_read"] = r.keys;
    d["store_bytes_read"] = r.bytes;
    d["store_reads"] = r.reads;
    d["store_writes"] = r.writes;
    return d;
  }, py::arg("size"), py::arg("per_host"), py::arg("id_bytes"), py::arg("name_bytes"), py::arg("record_bytes"),
        py::arg("endpoint_bytes"),
        "Set-up store reads and writes per rank, the most over ranks (engine/simulate.h): the host map combined "
        "in groups and encoded by set-up's own code, this host's records and endpoints");
}
