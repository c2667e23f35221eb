#pragma once
// The algorithms, one row each: what the rule (choose.h) returns, and everything else asks of
// it (how this rank runs each op the algorithm serves, its plan for the simulation and the peer
// count, what its name says of the job's shape). A new algorithm is its own file of run
// functions and one row here; nothing else names it.

#include <string>
#include <vector>

#include "common/types.h"
#include "engine/algorithms/choose.h"
#include "engine/algorithms/plan.h"

namespace railcc::engine {

class Algorithms;

struct AlgoRow {
  Algo algo;
  // How this rank runs each op the algorithm serves on host buffers (nullptr: not served).
  void (Algorithms::*allreduce)(char* buf, size_t count, DataType dt, ReduceOp op, double scale);
  void (Algorithms::*reduceScatter)(const std::vector<char*>& ins, char* out, size_t count, DataType dt, ReduceOp op,
                                  double scale);
  void (Algorithms::*allgather)(const char* in, size_t bytes, const std::vector<char*>& outs);
  void (Algorithms::*broadcast)(char* buf, size_t bytes, int root);
  bool copiesOwnPiece;  // its all-gather copies this rank's own piece itself (else the caller does, first)
  PlanFn plan;          // its phases: the simulation's schedule and the peers a rank meets
  bool simulated;       // false: the plan gives its peers only (the shared-memory rings of a one-host group)
  // Its name in the simulation's tables, with what the job's shape makes of it ("hier (rails: ring)").
  std::string (*describe)(const PlanShape& shape, AlgoOp op);
};

/// The row of `a`.
const AlgoRow& algoRow(Algo a);

}  // namespace railcc::engine
