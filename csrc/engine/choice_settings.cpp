#include "engine/choice_settings.h"

#include <vector>

#include "common/error.h"
#include "common/strings.h"
#include "engine/algorithms/choose.h"

namespace railcc::engine {

// Ranks that differ here would run different exchanges for one call: before this check, two
// identical all_reduce calls were reported as a "collective mismatch".
std::string choiceSettingsRecord(const Config& c) {
  std::string ignored, algos;
  for (Algo a : parseAlgos(c.algo, &ignored)) algos += (algos.empty() ? "" : ",") + std::string(algoName(a));
  return "\nRAILCC_ALGO=" + algos +                                          // which algorithm
         "\nRAILCC_ONESHOT_BYTES=" + std::to_string(c.oneshotBytes) +        // the rule's thresholds
         "\nRAILCC_CMA_BYTES=" + std::to_string(c.cmaBytes) +                //
         "\nRAILCC_BUCKET_SIZE=" + std::to_string(c.bucketSize) +            // coalesced ops' buckets
         "\nRAILCC_CHANNEL_MIN_BYTES=" + std::to_string(c.channelMinBytes);  // a message's channel shares
}

void checkSettingsAlike(const std::string& mine, const std::string& theirs, const std::string& context,
                        const std::string& me, const std::string& zero) {
  const std::vector<std::string> theirLines = split(theirs, '\n');
  std::string differ, names;
  for (const std::string& m : split(mine, '\n')) {
    if (m.empty()) continue;
    const std::string name = m.substr(0, m.find('='));
    names += (names.empty() ? "" : ", ") + name;
    std::string theirValue = "(not given)";
    for (const std::string& t : theirLines)
      if (t.compare(0, name.size() + 1, name + "=") == 0) theirValue = t.substr(name.size() + 1);
    const std::string myValue = m.substr(name.size() + 1);
    if (myValue == theirValue) continue;
    auto shown = [](const std::string& v) { return v.empty() ? std::string("unset") : v; };
    differ += std::string(differ.empty() ? "" : "; ") + name + " is " + shown(myValue) + " on " + me + " but " +
              shown(theirValue) + " on " + zero;
  }
  if (!differ.empty())
    RAILCC_THROW(kInvalidUsage, context, differ,
                 ". Each rank picks an op's algorithm from these settings on its own, so they must be alike on every "
                 "rank of a group (", names, "): set them once for the whole job");
}

}  // namespace railcc::engine
