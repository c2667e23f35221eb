#include <algorithm>
#include <set>
#include <sstream>

#include "common/log.h"
#include "engine/watchdog.h"

namespace railcc::engine {

// Stragglers and slow links (RAILCC_STRAGGLER_*): ranks that enter collective after collective
// far behind the others, from the arrival times the flight recorder keeps (Telemetry::lags),
// and links far below the median link of their class, from its throughput samples; checked on
// the watchdog's beat, reported on demand (railcc.straggler_report), and raised at the next op
// where RAILCC_STRAGGLER_ACTION=raise.

namespace {

std::string transportKind(const std::string& t) { return t.substr(0, t.find(' ')); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace

void Watchdog::checkStragglers() {
  std::lock_guard<std::mutex> serial(strag_.checkMu);  // the watchdog and straggler_report() both call this
  const Config& cfg = opts_.config;
  bool raise = cfg.stragglerAction == "raise";
  std::vector<std::string> news;
  std::vector<int> newRanks;
  // Compute stragglers: ranks that arrive last, by far, collective after collective.
  auto lags = tele_.lags();
  double limit = static_cast<double>(cfg.stragglerLagMs) * 1000.0;
  int minOps = static_cast<int>(std::min<int64_t>(8, cfg.stragglerWindow));
  // Only ranks this one heard from have lags (its algorithms' peers: a few at any job size),
  // so the comparison runs over those, not over every pair of ranks of the group.
  std::vector<size_t> heard;
  for (size_t r = 0; r < lags.size(); ++r)
    if (lags[r].ops > 0) heard.push_back(r);
  std::vector<double> others;
  for (size_t r : heard) {
    const auto& l = lags[r];
    others.clear();  // the typical rank, this one left out (with 2 ranks: the other)
    for (size_t q : heard)
      if (q != r) others.push_back(lags[q].meanUs);
    double med = median(others);
    bool bad = l.ops >= minOps && l.meanUs > limit && l.meanUs > 4 * med;
    if (bad && !strag_.lagFlagged[r]) {
      news.push_back(host_.rankName(r) + " (host " + peers_[r].hostname + ") is a straggler: it entered the last " +
                     std::to_string(l.ops) + " collectives " + formatNumber("%.1f", l.meanUs / 1000) + " ms after the first rank on average (max " +
                     formatNumber("%.1f", l.maxUs / 1000) + " ms; median rank " + formatNumber("%.1f", med / 1000) + " ms)");
      newRanks.push_back(static_cast<int>(r));
    }
    if (bad) strag_.lagFlagged[r] = true;
    else if (l.meanUs < limit / 2) strag_.lagFlagged[r] = false;
  }
  // Slow links: far below the median link of the same transport.
  auto links = tele_.links();
  auto byKind = ratesByClass(links);
  std::set<std::pair<int, bool>> flagged;
  for (auto& l : links) {
    auto& all = byKind[linkClass(l)];
    double m = median(all);
    if (l.samples < kMinLinkSamples || all.size() < 2 || l.gbps() >= m * static_cast<double>(cfg.stragglerLinkPct) / 100.0) continue;
    flagged.insert({l.peer, l.send});
    std::lock_guard<std::mutex> g(strag_.mu);
    if (strag_.linkFlagged.count({l.peer, l.send})) continue;
    int src = l.send ? rank_ : l.peer, dst = l.send ? l.peer : rank_;
    news.push_back("slow link: rank " + std::to_string(src) + " -> rank " + std::to_string(dst) + " (" +
                   peers_[src].hostname + " -> " + peers_[dst].hostname + ", " + host_.linkOf(static_cast<int>(l.peer)) + ") moves " +
                   formatNumber("%.3f", l.gbps()) + " GB/s against a median of " + formatNumber("%.3f", m) + " GB/s over the " +
                   std::to_string(all.size()) + " " + linkClass(l) + " links of rank " + std::to_string(rank_));
    newRanks.push_back(l.peer);
  }
  std::lock_guard<std::mutex> g(strag_.mu);
  strag_.linkFlagged = flagged;
  for (auto& m : news) RAILCC_WARN(WATCHDOG, m);
  if (raise && !news.empty()) {
    strag_.msg.clear();
    for (auto& m : news) strag_.msg += (strag_.msg.empty() ? "" : "\n") + m;
    strag_.pending.store(true);
    strag_.ranks = newRanks;
  }
}

std::string Watchdog::stragglerReport() {
  checkStragglers();
  std::ostringstream os;
  auto lags = tele_.lags();
  os << "{\"rank\": " << rank_ << ", \"window\": " << opts_.config.stragglerWindow << ", \"ranks\": [";
  {
    std::lock_guard<std::mutex> g(strag_.mu);
    for (size_t r = 0; r < lags.size(); ++r)
      os << (r ? ", " : "") << "{\"rank\": " << r << ", \"host\": " << jsonString(peers_[r].hostname)
         << ", \"lag_us_mean\": " << formatNumber("%.1f", lags[r].meanUs) << ", \"lag_us_max\": " << formatNumber("%.1f", lags[r].maxUs)
         << ", \"ops\": " << lags[r].ops << ", \"straggler\": " << (strag_.lagFlagged[r] ? "true" : "false") << "}";
  }
  os << "], \"links\": [";
  auto links = tele_.links();
  auto byKind = ratesByClass(links);
  std::set<std::pair<int, int>> slow;
  bool first = true;
  for (auto& l : links) {
    std::string kind = transportKind(host_.linkOf(static_cast<int>(l.peer)));
    double m = median(byKind[linkClass(l)]);
    int src = l.send ? rank_ : l.peer, dst = l.send ? l.peer : rank_;
    bool isSlow;
    {
      std::lock_guard<std::mutex> g(strag_.mu);
      isSlow = strag_.linkFlagged.count({l.peer, l.send}) > 0;
    }
    if (isSlow) slow.insert({src, dst});
    os << (first ? "" : ", ") << "{\"src\": " << src << ", \"dst\": " << dst << ", \"src_host\": "
       << jsonString(peers_[src].hostname) << ", \"dst_host\": " << jsonString(peers_[dst].hostname)
       << ", \"transport\": " << jsonString(kind) << ", \"link\": " << jsonString(host_.linkOf(static_cast<int>(l.peer))) << ", \"bytes\": " << l.bytes << ", \"samples\": " << l.samples << ", \"gbps\": " << formatNumber("%.4f", l.gbps())
       << ", \"median_gbps\": " << formatNumber("%.4f", m) << ", \"slow\": " << (isSlow ? "true" : "false") << "}";
    first = false;
  }
  // Slow links other ranks found (published with their progress records), read within 2 s in
  // all: at thousands of ranks the report must not wait 20 ms for each rank with no record.
  int unread = 0;
  if (opts_.config.progressIntervalMs > 0) {
    const Clock::time_point until = Clock::now() + Millis(2000);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const auto left = std::chrono::duration_cast<Millis>(until - Clock::now());
      if (left.count() <= 0) {
        unread = size_ - r - (rank_ > r ? 1 : 0);
        break;
      }
      std::string rec;
      if (!storeTryGet("progress/" + std::to_string(r), std::max(Millis(1), std::min(Millis(20), left)), rec)) continue;
      size_t pos = 0;
      while ((pos = rec.find("{\"src\": ", pos)) != std::string::npos) {
        long long a = std::strtoll(rec.c_str() + pos + 8, nullptr, 10), b = -1;
        jsonNumber(rec.substr(pos, rec.find('}', pos) - pos + 1), "dst", b);
        if (a >= 0 && a < size_ && b >= 0 && b < size_) slow.insert({static_cast<int>(a), static_cast<int>(b)});
        ++pos;
      }
    }
  }
  os << "], \"stragglers\": [";
  first = true;
  {
    std::lock_guard<std::mutex> g(strag_.mu);
    for (size_t r = 0; r < strag_.lagFlagged.size(); ++r)
      if (strag_.lagFlagged[r]) {
        os << (first ? "" : ", ") << r;
        first = false;
      }
  }
  os << "], \"slow_links\": [";
  first = true;
  for (auto& [a, b] : slow) {
    os << (first ? "" : ", ") << "{\"src\": " << a << ", \"dst\": " << b << ", \"src_host\": " << jsonString(peers_[a].hostname)
       << ", \"dst_host\": " << jsonString(peers_[b].hostname) << "}";
    first = false;
  }
  os << "], \"records_unread\": " << unread << "}";
  return os.str();
}

bool Watchdog::takePendingStraggler(std::string& msg, std::vector<int>& ranks) {
  std::lock_guard<std::mutex> g(strag_.mu);
  strag_.pending.store(false);
  if (strag_.msg.empty()) return false;
  msg.swap(strag_.msg);
  strag_.msg.clear();
  ranks = strag_.ranks;
  return true;
}

std::string Watchdog::linkClass(const Telemetry::LinkStats& l) const {
  std::string t = host_.linkOf(l.peer);
  return t.substr(0, t.find(' ')) + (l.send ? " send" : " receive");
}

// Throughputs of the links with enough samples, by class.
std::map<std::string, std::vector<double>> Watchdog::ratesByClass(const std::vector<Telemetry::LinkStats>& links) const {
  std::map<std::string, std::vector<double>> out;
  for (auto& l : links)
    if (l.samples >= kMinLinkSamples) out[linkClass(l)].push_back(l.gbps());
  return out;
}

}  // namespace railcc::engine
