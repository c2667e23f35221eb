#pragma once
// The settings every rank of a group must share because each rank decides from them alone how
// an op runs: its algorithm, its chunking, its channel shares. Rank 0 publishes its record
// with the group secret at set-up (bootstrap.cpp) and every other rank compares its own.
// The CUDA path's settings are compared where that path starts, at a group's first CUDA op
// (device/cuda_ipc.cpp).

#include <string>

#include "common/config.h"

namespace railcc::engine {

/// "\nNAME=value" for each such setting, in a fixed order: appended to the group secret.
std::string choiceSettingsRecord(const Config& c);

/// Throws kInvalidUsage naming every setting where `mine` (this rank's record) differs from
/// `theirs` (rank 0's), with both values; `context` starts the message, `me` and `zero` name
/// the two ranks.
void checkSettingsAlike(const std::string& mine, const std::string& theirs, const std::string& context,
                        const std::string& me, const std::string& zero);

}  // namespace railcc::engine
