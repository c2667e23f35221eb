#include "engine/records.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/strings.h"
#include "engine/communicator.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string_view>
#include <unordered_map>

namespace railcc::engine {

std::string hostIdentity(const Config& cfg) {
  if (!cfg.hostId.empty()) {
    // It travels inside '|'-separated store records: those characters would split it.
    for (char c : cfg.hostId)
      if (c == '|' || c == '\n' || c == '\r' || c == ';' || c == ' ' || static_cast<unsigned char>(c) < 0x20)
        RAILCC_THROW(kInvalidUsage, "RAILCC_HOST_ID='", cfg.hostId, "' contains '", c == '\n' ? std::string("\\n") : std::string(1, c),
                     "'; use letters, digits and - _ . : / @ (any string without '|', ';', spaces or control characters)");
    if (cfg.hostId.size() > 256)
      RAILCC_THROW(kInvalidUsage, "RAILCC_HOST_ID is ", cfg.hostId.size(), " characters long; at most 256 are accepted");
    return cfg.hostId;
  }
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  struct stat st {};
  unsigned long long netns = 0;
  if (stat("/proc/self/ns/net", &st) == 0) netns = static_cast<unsigned long long>(st.st_ino);
  return boot + ":" + std::to_string(netns);
}

std::string pidNamespace() {
  char buf[64] = {0};
  ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "unknown";
}

std::string affinityHex() {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (sched_getaffinity(0, sizeof(cpus), &cpus) != 0) return "0";
  int top = 0;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &cpus)) top = c;
  std::string hex;
  for (int base = top / 4 * 4; base >= 0; base -= 4) {
    int d = 0;
    for (int b = 0; b < 4; ++b)
      if (CPU_ISSET(base + b, &cpus)) d |= 1 << b;
    hex += "0123456789abcdef"[d];
  }
  return hex;
}

HostMap HostMap::one(const std::string& id, const std::string& name) {
  HostMap p;
  p.hosts.push_back({id, name});
  p.runs.push_back({0, 1});
  return p;
}

HostMap HostMap::concat(const std::vector<const HostMap*>& parts) {
  // By id, in one index for the whole merge: not a scan per host, nor an index rebuilt per part
  // (the last merge of 4,096 hosts of one rank takes 16 parts).
  HostMap out;
  std::unordered_map<std::string, int> known;
  for (const HostMap* o : parts) {
    std::vector<int> index(o->hosts.size());
    for (size_t i = 0; i < o->hosts.size(); ++i) {
      auto [it, added] = known.emplace(o->hosts[i].id, static_cast<int>(out.hosts.size()));
      if (added) out.hosts.push_back(o->hosts[i]);
      index[i] = it->second;
    }
    for (const auto& [h, n] : o->runs) {
      const int mapped = index[static_cast<size_t>(h)];
      if (!out.runs.empty() && out.runs.back().first == mapped) out.runs.back().second += n;
      else out.runs.push_back({mapped, n});
    }
  }
  return out;
}

int HostMap::ranks() const {
  int n = 0;
  for (const auto& r : runs) n += r.second;
  return n;
}

std::vector<int> HostMap::hostOfRank() const {
  std::vector<int> out;
  out.reserve(static_cast<size_t>(ranks()));
  for (const auto& [h, n] : runs) out.insert(out.end(), static_cast<size_t>(n), h);
  return out;
}

std::string HostMap::encode() const {
  std::string s;
  for (const Host& h : hosts) s += "h|" + h.id + "|" + (h.name.empty() ? std::string("-") : h.name) + "\n";
  for (const auto& [h, n] : runs) s += "r|" + std::to_string(h) + "|" + std::to_string(n) + "\n";
  return s;
}

HostMap HostMap::decode(const std::string& s, const std::string& who, int ranks) {
  HostMap p;
  auto bad = [&](std::string_view line, const std::string& why) {
    RAILCC_THROW(kInvalidUsage, who, ": its placement record in the store has the line '", quoteBytes(std::string(line), 120),
                 "' (", why, "; a store record written by something other than railcc?)");
  };
  // Read in place, a line and its fields at a time: one record of 4,096 hosts would otherwise
  // make a string per line and per field, a few hundred KiB of heap each rank keeps touched.
  size_t hosts = 0;  // lines that start with 'h'
  for (size_t i = 0; i < s.size(); ++i) hosts += s[i] == 'h' && (i == 0 || s[i - 1] == '\n');
  if (hosts > static_cast<size_t>(ranks))
    RAILCC_THROW(kInvalidUsage, who, ": its placement record in the store names ", hosts, " hosts for ", ranks,
                 " ranks (a store record written by something other than railcc?)");
  p.hosts.reserve(hosts);
  int64_t total = 0;  // ranks named so far: checked before anything grows with them
  std::string_view rest(s);
  while (!rest.empty()) {
    const size_t eol = rest.find('\n');
    const std::string_view line = rest.substr(0, eol);
    rest = eol == std::string_view::npos ? std::string_view() : rest.substr(eol + 1);
    if (line.empty()) continue;
    const size_t a = line.find('|'), b = a == std::string_view::npos ? a : line.find('|', a + 1);
    if (a != 1 || b == std::string_view::npos || b + 1 == line.size() || line.find('|', b + 1) != std::string_view::npos)
      bad(line, "not 3 fields separated by '|'");
    const std::string_view f1 = line.substr(2, b - 2), f2 = line.substr(b + 1);
    if (line[0] == 'h') {
      if (f1.empty()) bad(line, "an empty host id");
      if (!printableText(f1) || !printableText(f2)) bad(line, "bytes that are not printable text");
      p.hosts.push_back({std::string(f1), std::string(f2)});
    } else if (line[0] == 'r') {
      long long h = 0, n = 0;
      if (!parseInt(std::string(f1), 0, static_cast<long long>(p.hosts.size()) - 1, h)) bad(line, "a host index out of range");
      if (!parseInt(std::string(f2), 1, 1 << 24, n)) bad(line, "a rank count that is not a number from 1");
      total += n;
      if (total > ranks) bad(line, "more than the " + std::to_string(ranks) + " ranks it covers");
      p.runs.push_back({static_cast<int>(h), static_cast<int>(n)});
    } else {
      bad(line, "neither a host nor a run");
    }
  }
  if (p.runs.empty()) RAILCC_THROW(kInvalidUsage, who, ": its placement record in the store names no ranks");
  if (total != ranks)
    RAILCC_THROW(kInvalidUsage, who, ": its placement record in the store names ", total, " ranks where it covers ", ranks,
                 " (a store record written by something other than railcc, or another job using the same store prefix?)");
  return p;
}

int gatherParts(int size, int level) {
  int64_t parts = std::max(size, 1);
  for (int l = 0; l < level; ++l) parts = (parts + kGatherRadix - 1) / kGatherRadix;
  return static_cast<int>(parts);
}

int gatherLevels(int size) {
  int level = 0;
  while (gatherParts(size, level) > 1) ++level;
  return level;
}

std::pair<int, int> gatherMembers(int size, int level, int group) {
  const int below = gatherParts(size, level - 1), first = group * kGatherRadix;
  return {first, std::max(0, std::min(kGatherRadix, below - first))};
}

std::pair<int64_t, int64_t> gatherSpan(int size, int level, int index) {
  int64_t span = 1;
  for (int l = 0; l < level; ++l) span *= kGatherRadix;
  const int64_t first = index * span;
  return {first, std::min<int64_t>(size, first + span) - 1};
}

std::string gatherPartKey(int level, int index) {
  return level == 0 ? "place/" + std::to_string(index) : "place/" + std::to_string(level) + "/" + std::to_string(index);
}

bool combineHostMap(Store& store, int rank, int size, HostMap& mine, std::chrono::milliseconds timeout,
                    const std::string& group, const std::function<std::string(int, int)>& who) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  const int levels = gatherLevels(size);
  store.set(gatherPartKey(0, rank), mine.encode());
  int index = rank;  // this rank's part (or the merge it made) at level - 1
  for (int level = 1; level <= levels; ++level) {
    const int g = index / kGatherRadix;
    const auto [first, count] = gatherMembers(size, level, g);
    const std::string counter = "gather/" + std::to_string(level) + "/" + std::to_string(g);
    const int64_t arrived = store.add(counter, 1);
    if (arrived >= 1 && arrived < count) return false;
    if (arrived != count)
      RAILCC_THROW(kInvalidUsage, "railcc init of group '", group, "': store key '", counter, "' counts ", arrived,
                   " parts of the host map where its group has ", count, ": another job or group is using the same store prefix?");
    // The last of its group: every other part is there (each was set before its count).
    std::vector<std::string> keys;
    for (int i = first; i < first + count; ++i)
      if (i != index) keys.push_back(gatherPartKey(level - 1, i));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    const std::vector<std::string> vals = store.getAll(keys, std::max(left, std::chrono::milliseconds(1)));
    std::vector<HostMap> theirs;
    theirs.reserve(vals.size());
    std::vector<const HostMap*> inOrder;
    for (int i = first; i < first + count; ++i) {
      if (i == index) {
        inOrder.push_back(&mine);
        continue;
      }
      const auto [lo, hi] = gatherSpan(size, level - 1, i);
      theirs.push_back(HostMap::decode(vals[theirs.size()], who(level - 1, i), static_cast<int>(hi - lo + 1)));
      inOrder.push_back(&theirs.back());
    }
    mine = HostMap::concat(inOrder);
    index = g;
    store.set(level == levels ? std::string("hosts") : gatherPartKey(level, g), mine.encode());
  }
  return true;
}

void throwMissingPart(Store& store, int size, int64_t timeoutSec, const std::function<std::string(int, int)>& who) {
  for (int level = 0; level < gatherLevels(size); ++level)
    for (int i = 0; i < gatherParts(size, level); ++i) {
      try {
        store.get(gatherPartKey(level, i), std::chrono::milliseconds(1));
      } catch (const Error& missing) {
        if (missing.code() != ErrorCode::kTimeout) throw;
        RAILCC_THROW(kTimeout, who(level, i), " never reached the store within RAILCC_INIT_TIMEOUT=", timeoutSec,
                     " s though every rank published its host identity: the rank that completed that part of the ",
                     "gather died or stalled during init (store key '", gatherPartKey(level, i), "' still unset)");
      }
    }
  // Every part is there, so a count never completed: something else counted on the same keys.
  for (int level = 1; level <= gatherLevels(size); ++level)
    for (int g = 0; g < gatherParts(size, level); ++g) {
      const std::string counter = "gather/" + std::to_string(level) + "/" + std::to_string(g);
      const int64_t counted = store.add(counter, 0), members = gatherMembers(size, level, g).second;
      if (counted != members)
        RAILCC_THROW(kInvalidUsage, "store key '", counter, "' counts ", counted, " parts of the host map where its group has ",
                     members, ", so the gather never completed within RAILCC_INIT_TIMEOUT=", timeoutSec,
                     " s: another job or group is using the same store prefix, or something else wrote that key?");
    }
}

bool ranksOutnumberCpus(const std::vector<std::string>& masks) {
  std::vector<bool> any;
  for (const std::string& h : masks) {
    if (any.size() < 4 * h.size()) any.resize(4 * h.size(), false);
    for (size_t i = 0; i < h.size(); ++i) {
      char ch = h[h.size() - 1 - i];
      int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : 0;
      for (int b = 0; b < 4; ++b)
        if (d & (1 << b)) any[4 * i + static_cast<size_t>(b)] = true;
    }
  }
  return static_cast<int>(masks.size()) > std::max<int>(static_cast<int>(std::count(any.begin(), any.end(), true)), 1);
}

std::vector<std::string> parsePeerRecord(const std::string& v, const std::string& who) {
  auto f = split(v, '|');
  long long pid = 0;
  if (f.size() != 5)
    RAILCC_THROW(kInvalidUsage, who, ": its host record in the store ('", quoteBytes(v, 200), "') has ", f.size(),
                 " fields separated by '|', not 5 (a store record written by something other than railcc?)");
  for (const std::string& field : f)
    if (!printableText(field))
      RAILCC_THROW(kInvalidUsage, who, ": its host record in the store ('", quoteBytes(v, 200),
                   "') holds bytes that are not printable text (a store record written by something other than railcc?)");
  if (!parseInt(f[2], 0, 1ll << 31, pid))
    RAILCC_THROW(kInvalidUsage, who, ": its host record in the store has pid '", f[2].substr(0, 32),
                 "', not a process id (a store record written by something other than railcc?)");
  return f;
}

Endpoints parseEndpoints(const std::string& v, const std::string& who) {
  Endpoints out;
  for (const std::string& line : split(v, '\n')) {
    auto a = line.find(' '), b = line.find(' ', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    long long channels = 0;
    if (!parseInt(line.substr(a + 1, b - a - 1), 0, 4096, channels))
      RAILCC_THROW(kInvalidUsage, who, ": its transport endpoint record for ", line.substr(0, a).substr(0, 32),
                   " has channel count '", line.substr(a + 1, b - a - 1).substr(0, 32),
                   "', not a number from 0 to 4096 (a store record written by something other than railcc?)");
    out[line.substr(0, a)] = {static_cast<int>(channels), line.substr(b + 1)};
  }
  return out;
}

std::string innermostReason(const std::string& reason) {
  std::string rest = reason;
  std::vector<std::string> via;
  while (rest.rfind("rank ", 0) == 0) {
    const size_t digits = rest.find_first_not_of("0123456789", 5);
    const size_t said = rest.find(") failed: "), eol = rest.find('\n');
    if (digits == 5 || said == std::string::npos || (eol != std::string::npos && said > eol)) break;
    via.push_back(rest.substr(5, digits - 5));
    rest = rest.substr(said + 10);
  }
  if (via.empty()) return reason;
  std::string by = " (passed on by rank" + std::string(via.size() > 1 ? "s " : " ");
  for (size_t i = 0; i < via.size() && i < 8; ++i) by += (i ? ", " : "") + via[i];
  if (via.size() > 8) by += " and " + std::to_string(via.size() - 8) + " more";
  const size_t eol = rest.find('\n');
  return eol == std::string::npos ? rest + by + ")" : rest.substr(0, eol) + by + ")" + rest.substr(eol);
}

int firstReaching(const std::vector<std::pair<std::string, transport::Setup*>>& candidates, const Endpoints& offers,
                  const std::string& peer, transport::PeerRecord& rec, std::string& why, std::string& tried) {
  for (size_t i = 0; i < candidates.size(); ++i) {
    const auto& [name, setup] = candidates[i];
    auto offer = offers.find(name);
    if (offer == offers.end()) {
      tried += "\n  " + name + ": " + peer + " does not offer it";
      continue;
    }
    transport::PeerRecord r = rec;
    r.channels = offer->second.first;
    r.endpoint = offer->second.second;
    why = setup->reach(r);
    if (why.empty()) {
      tried += "\n  " + name + ": cannot reach it from here";
      continue;
    }
    rec = r;
    return static_cast<int>(i);
  }
  return -1;
}

}  // namespace railcc::engine
