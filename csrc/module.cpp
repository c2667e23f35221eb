// Python bindings: the backend class, the translator that turns engine errors into
// railcc's exception classes, and small diagnostics used by the railcc package.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "allocator_trace.h"
#include "backend.h"
#include "common/config.h"
#include "common/error.h"
#include "engine/allocator_segments.h"
#include "engine/rail_check.h"
#include "rules_module.h"
#include "tensor_memory.h"
#include "transport/stats.h"
#include "topology/rails.h"
#include "topology/topology.h"

namespace py = pybind11;

namespace {

// Holds the backend; drops the GIL before the last reference goes, because destroying a
// communicator joins its progress thread, which may be running a Python future callback.
template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  NoGilHolder(const NoGilHolder&) = default;
  NoGilHolder(NoGilHolder&&) noexcept = default;
  NoGilHolder& operator=(const NoGilHolder&) = default;
  NoGilHolder& operator=(NoGilHolder&&) noexcept = default;
  /* implicit */ NoGilHolder(c10::intrusive_ptr<T> p) : p_(std::move(p)) {}
  explicit NoGilHolder(T* raw) : p_(c10::intrusive_ptr<T>::unsafe_steal_from_new(raw)) {}
  ~NoGilHolder() {
    if (!p_) return;
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      p_.reset();
    } else {
      p_.reset();
    }
  }
  T* get() const noexcept { return p_.get(); }
  T& operator*() const noexcept { return *p_; }
  T* operator->() const noexcept { return p_.get(); }

 private:
  c10::intrusive_ptr<T> p_;
};

const char* pythonClassFor(railcc::ErrorCode code) {
  switch (code) {
    case railcc::ErrorCode::kTimeout: return "CollectiveTimeoutError";
    case railcc::ErrorCode::kPeerFailure: return "PeerFailureError";
    case railcc::ErrorCode::kMismatch: return "CollectiveMismatchError";
    case railcc::ErrorCode::kAborted: return "AbortedError";
    case railcc::ErrorCode::kStraggler: return "StragglerError";
    default: return "RailccError";
  }
}

railcc::ProcessGroupRailcc& asRailcc(const c10::intrusive_ptr<c10d::Backend>& b) {
  auto* p = dynamic_cast<railcc::ProcessGroupRailcc*>(b.get());
  if (p == nullptr) throw py::type_error("not a railcc backend");
  return *p;
}

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilHolder<T>, true);

PYBIND11_MODULE(_C, m) {
  m.doc() = "railcc c10d backend (C++ extension)";
  py::module_::import("torch.distributed");
  // Registers c10d::Backend with pybind before we derive from it.
  py::module_::import("torch._C._distributed_c10d");

  py::class_<railcc::ProcessGroupRailcc, c10d::Backend, NoGilHolder<railcc::ProcessGroupRailcc>>(
      m, "ProcessGroupRailcc")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string name, std::vector<int> globalRanks) {
             return c10::make_intrusive<railcc::ProcessGroupRailcc>(store, rank, size, timeout, std::move(name),
                                                                    std::move(globalRanks));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name") = "",
           py::arg("global_ranks") = std::vector<int>{}, py::call_guard<py::gil_scoped_release>())
      .def("peer_transports", &railcc::ProcessGroupRailcc::peerTransports)
      .def("listen_address",
           [](railcc::ProcessGroupRailcc& self) { return self.comm().peers()[static_cast<size_t>(self.getRank())].addr; })
      .def("hosts", [](railcc::ProcessGroupRailcc& self) {
        std::vector<std::string> out;
        for (auto& p : self.comm().peers()) out.push_back(p.hostname);
        return out;
      })
      .def("collective_count", [](railcc::ProcessGroupRailcc& self) { return self.comm().collectiveCount(); })
      .def("trace_json", [](railcc::ProcessGroupRailcc& self) { return self.comm().traceJson("on demand"); },
           py::call_guard<py::gil_scoped_release>())
      .def("dump_trace",
           [](railcc::ProcessGroupRailcc& self, const std::string& dir) { return self.comm().dumpTrace("on demand", dir); },
           py::arg("dir") = "", py::call_guard<py::gil_scoped_release>())
      .def("straggler_report_json", [](railcc::ProcessGroupRailcc& self) { return self.comm().stragglerReport(); },
           py::call_guard<py::gil_scoped_release>())
      .def("abort_group", [](railcc::ProcessGroupRailcc& self, const std::string& why) {
        if (why.empty()) self.abort();
        else self.comm().abort(why);
      }, py::arg("why") = "", py::call_guard<py::gil_scoped_release>())
      // torch.distributed._time_estimator asks these of the backend object; the estimate is in
      // microseconds, as NCCL's.
      .def_property_readonly("supports_time_estimate", [](railcc::ProcessGroupRailcc&) { return true; })
      .def("_start_time_estimate", [](railcc::ProcessGroupRailcc& self) { self.comm().startTimeEstimate(); })
      .def("_end_time_estimate", [](railcc::ProcessGroupRailcc& self) { return self.comm().endTimeEstimate(); })
      // shrink (railcc/_shrink.py): torch.distributed.shrink_group asks the backend object.
      .def_property_readonly("supports_shrinking", [](railcc::ProcessGroupRailcc&) { return true; })
      // dist.split_group deep-copies the parent's `options` for the child, and c10d's base
      // Options cannot be copied from Python. None makes it pass none, and the C++ split
      // (ProcessGroup::splitGroup) then clones getBackendOptions() itself.
      .def_property_readonly("options", [](railcc::ProcessGroupRailcc&) { return py::none(); })
      // new_group on a rank left out of the new group, when the default group is bound to a
      // device and its backend splits: torch asks the split source to take part, as NCCL's
      // split is collective over the parent. railcc's child groups form among their own ranks.
      .def("perform_nocolor_split", [](railcc::ProcessGroupRailcc&, const py::object&) {}, py::arg("device") = py::none())
      .def("_c10d_store", [](railcc::ProcessGroupRailcc& self) { return self.c10dStore(); })
      .def("_timeout", [](railcc::ProcessGroupRailcc& self) { return self.timeout(); })
      .def("_group_name", [](railcc::ProcessGroupRailcc& self) { return self.groupName(); })
      .def("_global_ranks", [](railcc::ProcessGroupRailcc& self) { return self.globalRanks(); })
      .def("_drain", [](railcc::ProcessGroupRailcc& self, double seconds) {
        py::gil_scoped_release nogil;
        return self.comm().drain(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
      }, py::arg("seconds"))
      // The default-group ranks this rank knows to be dead or silent: those the error that broke
      // the group blames (a peer that exited, closed its connections or never answered), and
      // those another group of this rank saw die since. A rank blamed without being seen dead
      // (a timeout, a failure passed on by a peer) is named only while it is still silent, so
      // that the recipe shrink_group(failed_ranks(...)) never leaves out a live rank.
      .def("failed_ranks", [](railcc::ProcessGroupRailcc& self) {
        std::vector<int> out;
        std::exception_ptr err = self.comm().brokenError();
        if (!err) return out;
        const int me = self.globalRanks()[static_cast<size_t>(self.getRank())];
        for (int g : self.comm().laterDead())
          if (g != me) out.push_back(g);  // seen dead by another group after this one broke
        try {
          std::rethrow_exception(err);
        } catch (const railcc::Error& e) {
          if (e.code() != railcc::ErrorCode::kPeerFailure && e.code() != railcc::ErrorCode::kTimeout) return out;
          std::vector<int> blamed;
          for (int r : e.ranks) {
            int g = e.ranksGlobal || r < 0 || r >= static_cast<int>(self.globalRanks().size())
                        ? r : self.globalRanks()[static_cast<size_t>(r)];
            if (g != me) blamed.push_back(g);
          }
          if (!e.ranksDead) {
            py::gil_scoped_release nogil;  // reads the store
            blamed = self.comm().stillSilent(blamed);
          }
          out.insert(out.end(), blamed.begin(), blamed.end());
        } catch (...) {
        }
        return out;
      });

  m.def("params", [] {
    py::list rows;
    for (const auto& p : railcc::describeParams()) {
      py::dict d;
      d["name"] = p.name;
      d["env"] = p.env;
      d["fallback"] = p.fallback;
      d["type"] = p.type;
      d["default"] = p.defaultValue;
      d["allowed"] = p.allowed;
      d["problem"] = p.problem;
      d["description"] = p.description;
      d["value"] = p.value;
      d["source"] = p.source;
      rows.append(d);
    }
    return rows;
  });

  // What backend.mem_allocator returns: a handle (the allocator is used from C++).
  py::class_<railcc::CommunicationAllocator, std::shared_ptr<railcc::CommunicationAllocator>>(
      m, "CommunicationAllocator", "railcc's allocator of page-aligned host memory for communication tensors");

  m.def("stats", [] {
    py::dict out;
    for (const auto& [transport, row] : railcc::transport::statsSnapshot()) {
      py::dict d;
      for (const auto& [name, v] : row) d[py::str(name)] = v;
      out[py::str(transport)] = d;
    }
    return out;
  });
  m.def("reset_stats", [] { railcc::transport::resetStats(); });
  // The CUDA caching allocator's hook, as the allocator calls it (TraceEntry's action, address,
  // size), and the segments it told of: for tests that need no GPU.
  m.def("_allocator_traced", [](int action, size_t addr, size_t size) { railcc::allocatorTraced(action, addr, size); });
  m.def("_allocator_segments", [] { return railcc::engine::segmentsKnown(); });
  m.def("_watch_allocator", [] { return railcc::watchAllocatorSegments(); });

  m.def("cuda_info", [] {
    // Loads the CUDA plugin if it can: what railcc would use for CUDA tensors, or why not.
    py::dict d;
    std::string why;
    bool ok = railcc::engine::deviceApiAvailable(&why);
    d["plugin"] = ok;
    d["runtime"] = ok ? py::object(py::str(railcc::engine::deviceApi().name)) : py::object(py::none());
    int n = 0;
    if (ok) {
      int err = railcc::engine::deviceApi().deviceCount(&n);
      if (err != 0) {
        why = std::string("cudaGetDeviceCount failed: ") + railcc::engine::deviceApi().errorString(err);
        n = 0;
      }
    }
    d["devices"] = n;
    d["gpu_direct"] = py::none();
    try {
      if (n > 0) d["gpu_direct"] = railcc::engine::probeGpuDirect(0);
    } catch (const std::exception& e) {
      d["gpu_direct"] = std::string("cuda:0: ") + e.what();
    }
    d["error"] = why.empty() ? py::object(py::none()) : py::object(py::str(why));
    return d;
  });

  m.def("check_rails", [](const std::vector<std::string>& lines) {
    // What rank 0 says at init of these ranks' rail lines: for `railcc topo --all-ranks`.
    railcc::engine::RailCheck c = railcc::engine::checkRailLines(lines);
    py::dict d;
    d["hosts"] = c.hosts;
    d["rails"] = c.rails;
    d["problems"] = c.problems;
    d["agreed"] = c.agreed;
    return d;
  });

  m.def("topology", [](const std::string& xmlFile, const std::vector<std::string>& gpuBusIds,
                       const std::vector<std::pair<int, int>>& places) {
    // The machine (or an hwloc XML file) as csrc/topology sees it, and the rail of each
    // (gpu, numa) local rank: what `railcc topo` prints.
    namespace topo = railcc::topology;
    topo::DiscoverOptions o;
    o.xmlFile = xmlFile;
    o.gpuBusIds = gpuBusIds;
    topo::Topology t;
    std::vector<topo::Assignment> rails;
    {
      py::gil_scoped_release nogil;
      t = topo::discover(o);
      std::vector<topo::RankPlace> rp;
      for (auto& [g, n] : places) rp.push_back({g, n});
      rails = topo::assignRails(t, rp);
    }
    auto pci = [](py::dict& d, const topo::PciDevice& p) {
      d["bus_id"] = p.busId;
      d["numa"] = p.numa;
      d["link_gbs"] = p.linkGBs;
    };
    py::dict d;
    d["source"] = t.source;
    d["method"] = t.method;
    d["hostname"] = t.hostname;
    d["numa_nodes"] = t.numaNodes;
    py::list gpus, nics, paths, out;
    for (const auto& g : t.gpus) {
      py::dict x;
      pci(x, g.pci);
      x["found"] = g.found;
      gpus.append(x);
    }
    for (const auto& n : t.nics) {
      py::dict x;
      x["name"] = n.name;
      x["rdma"] = n.rdma;
      x["netdevs"] = n.netdevs;
      pci(x, n.pci);
      nics.append(x);
    }
    for (size_t g = 0; g < t.gpus.size(); ++g) {
      py::list row;
      for (size_t n = 0; n < t.nics.size(); ++n) row.append(topo::pathName(t.path(g, n)));
      paths.append(row);
    }
    for (const auto& a : rails) {
      py::dict x;
      x["nic"] = a.nic;
      x["rail"] = a.rail;
      x["path"] = topo::pathName(a.path);
      x["why"] = a.why;
      out.append(x);
    }
    d["gpus"] = gpus;
    d["nics"] = nics;
    d["paths"] = paths;
    d["rails"] = out;
    d["xml"] = t.xml;
    return d;
  });

  m.def("peer_transports", [](const c10::intrusive_ptr<c10d::Backend>& b) { return asRailcc(b).peerTransports(); });

  registerRules(m);  // railcc._C.rules: the host rules railcc doctor asks

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const railcc::RailccError& e) {
      try {
        py::object errors = py::module_::import("railcc._errors");
        py::object cls = errors.attr(pythonClassFor(e.code));
        std::string msg = e.what_without_backtrace();
        // A group that lost a rank can go on without it; say how (not for init: nothing to shrink yet).
        if (e.code == railcc::ErrorCode::kPeerFailure && e.ranksDead && msg.rfind("railcc init", 0) != 0)
          msg += "\nTo go on without the dead rank(s), every rank that stays calls torch.distributed.shrink_group("
                 "railcc.failed_ranks(group, group_ranks=True), group, shrink_flags=SHRINK_ABORT) (group: this op's, "
                 "None for the default one) and uses the group it returns; shrinking the default group destroys the "
                 "other groups, so create them again from the shrunk one";
        py::object inst = cls(msg);
        inst.attr("code") = railcc::errorCodeName(e.code);
        inst.attr("ranks") = py::cast(e.ranks);
        std::vector<std::string> hosts;  // from records other processes wrote: text Python can decode
        for (const std::string& h : e.hosts) hosts.push_back(railcc::quoteBytes(h, 256));
        inst.attr("hosts") = py::cast(hosts);
        inst.attr("seq") = e.seq < 0 ? py::object(py::none()) : py::object(py::int_(e.seq));
        inst.attr("op") = e.op.empty() ? py::object(py::none()) : py::object(py::str(e.op));
        PyErr_SetObject(cls.ptr(), inst.ptr());
      } catch (py::error_already_set& inner) {
        inner.restore();
      }
    }
  });
}
