#pragma once
// c10d glue: the engine's Store (engine/store.h) over a c10d::Store.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "engine/communicator.h"  // engine::Store

namespace railcc {

/// Waits on keys without ever letting a c10d wait expire (an expired TCPStore wait prints a
/// warning and asks DNS for the peer's name), reads a group's records in one multi_get, and
/// knows when the store's host is gone for good (a watch connection opened on first ask).
/// `askers`: the ranks of the group that wait on it together (its asks grow sparser with them).
std::shared_ptr<engine::Store> makeC10dStore(c10::intrusive_ptr<c10d::Store> s, int askers);

}  // namespace railcc
