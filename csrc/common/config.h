#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace railcc {

// The single table of railcc's parameters. Each row gives the member name, its type, the
// environment variable, an NCCL_* fallback that means the same thing (or ""), the default,
// the values allowed ("lo..hi" for numbers, "a|b|c" for a choice, "" for anything), and a
// description. The Config struct, the env listing (`python -m railcc env`) and the
// table in docs/configuration.md are all generated from these rows, so a parameter is added in one place.
#define RAILCC_PARAMS(X)                                                                      \
  X(debug, std::string, "RAILCC_DEBUG", "NCCL_DEBUG", "WARN", "",                                 \
    "Log level: WARN, INFO or TRACE (VERSION is read as INFO).")                              \
  X(debugSubsys, std::string, "RAILCC_DEBUG_SUBSYS", "NCCL_DEBUG_SUBSYS", "ALL", "",              \
    "Comma list of subsystems to log: INIT,NET,IB,SHM,COLL,P2P,WATCHDOG,ENV (^ inverts).")    \
  X(debugFile, std::string, "RAILCC_DEBUG_FILE", "NCCL_DEBUG_FILE", "", "",                       \
    "Write the log to this file instead of stderr; %h is replaced by the host, %p by the pid.") \
  X(buffSize, int64_t, "RAILCC_BUFFSIZE", "NCCL_BUFFSIZE", "4194304", "4096..68719476736",                         \
    "Bytes of each rank's shared-memory broadcast ring and, unless RAILCC_SHM_FIFO_BYTES "    \
    "says otherwise, of each FIFO (shm memory: reserved as it is first written); and of the " \
    "verbs "                                                                                  \
    "transport's receive ring and send staging area, each capped at 512 MiB and pinned, per "  \
    "connection (peer on another host, lane and channel). Must be equal on a host's ranks.")  \
  X(shmFifoBytes, int64_t, "RAILCC_SHM_FIFO_BYTES", "", "0", "0..68719476736",                               \
    "Bytes of each shared-memory FIFO (one per same-host peer, lane and direction), at least " \
    "4096; 0: RAILCC_BUFFSIZE. Smaller FIFOs keep the cache for the data when many ranks "    \
    "share a host (all-to-all), larger ones let pipelined ops run ahead (reduce, broadcast). " \
    "Must be equal on a host's ranks.")                                                       \
  X(cmaBytes, int64_t, "RAILCC_CMA_BYTES", "", "-1", "-1..68719476736",                          \
    "In all-gather and all-to-all steps (every rank sending and receiving at once), messages " \
    "of at least this many bytes (and 4096) between ranks of one host move in one copy: the " \
    "receiver reads the sender's buffer through the kernel (process_vm_readv) instead of both " \
    "copying through a shared-memory FIFO. 0: never. -1: 16384, or 65536 where the host's " \
    "ranks outnumber their CPUs (measured: below those sizes the FIFO's two copies win). " \
    "Where the kernel refuses " \
    "it (Yama ptrace_scope, seccomp, no CAP_SYS_PTRACE across users, another pid namespace) " \
    "the FIFO carries them and INFO (SHM) says why, once. Where the host's ranks outnumber " \
    "their CPUs it also decides how all-gather runs (from it, each block read from its owner; " \
    "below it, the shared-memory rings): set it alike on every rank of a host.")                                   \
  X(stagingSize, int64_t, "RAILCC_STAGING_SIZE", "", "1048576", "4096..1073741824",                               \
    "Bytes of the staging buffer a receive-and-reduce from a socket goes through.")           \
  X(cudaStagingBytes, int64_t, "RAILCC_CUDA_STAGING_BYTES", "", "33554432", "8192..68719476736",                  \
    "Bytes of pinned host memory per group through which collectives on CUDA tensors are "    \
    "staged (two halves, so copies overlap the network). Must be equal on all ranks.")      \
  X(cudaIpc, bool, "RAILCC_CUDA_IPC", "", "1", "",                                                \
    "1: when every rank of a group is on one host, collectives on CUDA tensors go through "   \
    "CUDA IPC (GPU copies and reduction kernels read the peers' device memory); 0: always "   \
    "stage through pinned host memory. Must be equal on all ranks.")                         \
  X(cudaIpcBytes, int64_t, "RAILCC_CUDA_IPC_BYTES", "", "16777216", "4096..68719476736",                          \
    "Bytes of device memory per rank and group for the CUDA IPC path (four chunk buffers, "   \
    "peers map them). Must be equal on all ranks.")                                          \
  X(cudaShots, bool, "RAILCC_CUDA_SHOTS", "", "0", "",                                            \
    "1: on the CUDA IPC path, all-reduce (one-shot up to RAILCC_ONESHOT_BYTES, two-shot "    \
    "above), broadcast, all-gather and reduce-scatter of one tensor, and all-to-all of equal "  \
    "splits in one tensor run as one kernel per "                                               \
    "tensor that reads the peers' device memory and waits on signals in it, with no host "    \
    "round per chunk. Off by default until measured on a GPU (scripts/gpu_check.sh runs "     \
    "both). Must be equal on all ranks.")                                                     \
  X(cudaIpcSignals, bool, "RAILCC_CUDA_IPC_SIGNALS", "", "0", "",                                 \
    "1: the CUDA IPC path's steps (every rank's copies of a chunk done, before anyone reads or " \
    "reuses it) are ordered by the ranks' streams writing and waiting on counters in each "     \
    "other's device memory (stream memory operations), not by a host round per step: the "    \
    "copies run on the copy engines with nothing on the host between the call and the GPU's "  \
    "end. Off by default until measured on a GPU. Must be equal on all ranks.")              \
  X(cudaShotBlocks, int64_t, "RAILCC_CUDA_SHOT_BLOCKS", "", "64", "1..64",                       \
    "Most thread blocks (512 threads each) of a one-kernel collective (RAILCC_CUDA_SHOTS): "   \
    "a call takes one per 128 KiB up to this many. Under MPS every rank's blocks must fit on " \
    "the GPU at once (ranks x blocks <= SMs x 4). Must be equal on all ranks.")               \
  X(cudaHeapBytes, int64_t, "RAILCC_CUDA_HEAP_BYTES", "", "268435456", "0..1099511627776",                  \
    "With RAILCC_CUDA_SHOTS=1: bytes of device memory per rank and group from which "         \
    "allocate_tensor (FSDP2's communication buffers) carves CUDA tensors that peers map once "  \
    "and read in place, sparing the one-kernel ops their copy into the scratch; made at the "  \
    "first such call or the group's first CUDA op. A buffer that does not fit comes from "     \
    "torch's allocator. 0: none.")                                                             \
  X(bucketSize, int64_t, "RAILCC_BUCKET_SIZE", "", "8388608", "1..68719476736",                                 \
    "Bytes of the fusion bucket for coalesced all-reduce; small tensors are packed into it.") \
  X(oneshotBytes, int64_t, "RAILCC_ONESHOT_BYTES", "", "65536", "0..67108864",                              \
    "All-reduce and reduce-scatter of at most this many bytes per block run in one step: "     \
    "every rank sends to every peer and reduces in rank order. A CUDA IPC all-reduce of at "  \
    "most this many bytes has every rank reduce every peer's buffer. Where a host has more "  \
    "ranks than CPUs and the shm rings can run it, the rule stops at 16384 (RAILCC_ALGO="      \
    "oneshot keeps this value). Must be equal on all ranks.")                                 \
  X(algo, std::string, "RAILCC_ALGO", "NCCL_ALGO", "", "",                                         \
    "Algorithms to prefer, comma separated: oneshot, rings, hier, pairwise, ring, tree, chain, " \
    "direct (ring also takes chain for broadcast; collnet/nvls/pat are skipped). Per op, the first listed " \
    "that can run it wins, else the size/placement rule. Must be equal on all ranks.")       \
  X(socketIfname, std::string, "RAILCC_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "", "",              \
    "Interfaces for TCP: prefixes, comma separated; ^ excludes, = matches exactly. "          \
    "Default: the first up interface that is not loopback or docker.")                        \
  X(net, std::string, "RAILCC_NET", "NCCL_NET", "", "",                                            \
    "Forces the transport between hosts by name (verbs or socket; NCCL's IB and Socket too). "  \
    "Empty: the most preferred transport both sides can use. Logged per peer at INFO.")      \
  X(nchannels, int64_t, "RAILCC_NCHANNELS", "", "0", "0..64",                                    \
    "Connections per peer pair between hosts; large messages are split across them, and "     \
    "each is bound to one interface of RAILCC_SOCKET_IFNAME in turn (to the rank's rail " \
    "interface when the topology names one). 0: "                    \
    "RAILCC_NSOCKS_PERTHREAD x RAILCC_SOCKET_NTHREADS. Always within the MIN/MAX bounds.")    \
  X(minNchannels, int64_t, "RAILCC_MIN_NCHANNELS", "NCCL_MIN_NCHANNELS", "1", "1..64",         \
    "Lower bound on the channels per peer pair.")                                            \
  X(maxNchannels, int64_t, "RAILCC_MAX_NCHANNELS", "NCCL_MAX_NCHANNELS", "64", "1..64",        \
    "Upper bound on the channels per peer pair.")                                            \
  X(nsocksPerThread, int64_t, "RAILCC_NSOCKS_PERTHREAD", "NCCL_NSOCKS_PERTHREAD", "1", "1..64", \
    "TCP: sockets per channel thread; with RAILCC_SOCKET_NTHREADS gives the default channel " \
    "count (one progress thread drives them all).")                                          \
  X(socketNthreads, int64_t, "RAILCC_SOCKET_NTHREADS", "NCCL_SOCKET_NTHREADS", "1", "1..16",   \
    "TCP: see RAILCC_NSOCKS_PERTHREAD.")                                                     \
  X(crossNic, int64_t, "RAILCC_CROSS_NIC", "NCCL_CROSS_NIC", "2", "0..2",                      \
    "Where the topology names each rank's NIC (rail): 0 and 2 carry a pair's traffic between " \
    "hosts on one rail, the dialing (lower) rank's, on both ends; 2 falls back to the peer's "  \
    "own rail when its host lacks that one, 0 warns too; 1 lets each end use its own rail.")   \
  X(channelMinBytes, int64_t, "RAILCC_CHANNEL_MIN_BYTES", "", "262144", "4096..1073741824",  \
    "A message is split across a pair's channels only into shares of at least this many "    \
    "bytes. Must be equal on all ranks.")                                                    \
  X(runtimeConnect, bool, "RAILCC_RUNTIME_CONNECT", "NCCL_RUNTIME_CONNECT", "1", "",             \
    "1: a connection between hosts (TCP: per peer, lane and channel; RDMA verbs: a queue pair " \
    "and its rings) is made at the first op that moves bytes over it: a ring or tree "         \
    "all-reduce meets a few peers, not all, and init connects none; a rank waiting for a peer " \
    "to dial knocks on that peer's listener, so a peer that died first is still named within " \
    "seconds. 0: init connects the peers this rank's collectives meet (all-reduce, "           \
    "reduce-scatter, all-gather, barrier, broadcast from rank 0, at every size the rule "      \
    "distinguishes) and fails naming any it cannot reach; other roots, send/recv and "         \
    "all-to-all still connect at first use. Shared memory always connects at init. Should be " \
    "equal on all ranks.")                                                                     \
  X(ibDisable, bool, "RAILCC_IB_DISABLE", "NCCL_IB_DISABLE", "0", "",                            \
    "1: never use RDMA verbs between hosts (TCP instead); logged once at INFO.")            \
  X(ibverbsLib, std::string, "RAILCC_IBVERBS_LIB", "", "", "",                                  \
    "The libibverbs to load at run time instead of libibverbs.so.1 (a path or a soname).")  \
  X(ibHca, std::string, "RAILCC_IB_HCA", "NCCL_IB_HCA", "", "",                                  \
    "RDMA devices and ports to use: mlx5_0:1,mlx5_1 (prefixes), ^ excludes, = exact names. " \
    "Default: every device with an ACTIVE port.")                                            \
  X(ibGidIndex, int64_t, "RAILCC_IB_GID_INDEX", "NCCL_IB_GID_INDEX", "-1", "-1..1023",           \
    "RoCE: the GID index to use on every port. -1: the first RoCE v2 (RAILCC_IB_ROCE_VERSION_NUM), " \
    "IPv4-mapped (RAILCC_IB_ADDR_FAMILY), non-link-local GID inside RAILCC_IB_ADDR_RANGE.")  \
  X(ibRoceVersion, int64_t, "RAILCC_IB_ROCE_VERSION_NUM", "NCCL_IB_ROCE_VERSION_NUM", "2", "1..2", \
    "RoCE version of the GID picked automatically.")                                        \
  X(ibAddrFamily, std::string, "RAILCC_IB_ADDR_FAMILY", "NCCL_IB_ADDR_FAMILY", "AF_INET", "AF_INET|AF_INET6", \
    "Address family of the GID picked automatically.")                                      \
  X(ibAddrRange, std::string, "RAILCC_IB_ADDR_RANGE", "NCCL_IB_ADDR_RANGE", "", "",              \
    "Only GIDs inside this IPv4 range (10.77.0.0/16) are picked automatically.")           \
  X(ibTimeout, int64_t, "RAILCC_IB_TIMEOUT", "NCCL_IB_TIMEOUT", "20", "1..31",                   \
    "Queue-pair ACK timeout, 4.096 us x 2^value per try.")                                   \
  X(ibRetryCnt, int64_t, "RAILCC_IB_RETRY_CNT", "NCCL_IB_RETRY_CNT", "7", "0..7",               \
    "Retries before a work request fails with 'retry exceeded' (the peer is gone or "       \
    "unreachable).")                                                                         \
  X(ibTc, int64_t, "RAILCC_IB_TC", "NCCL_IB_TC", "0", "0..255",                                  \
    "Traffic class of RoCE packets.")                                                        \
  X(ibSl, int64_t, "RAILCC_IB_SL", "NCCL_IB_SL", "0", "0..15",                                   \
    "InfiniBand service level.")                                                             \
  X(ibPkey, int64_t, "RAILCC_IB_PKEY", "NCCL_IB_PKEY", "0", "0..65535",                          \
    "Partition key index of the queue pairs.")                                               \
  X(ibQpsPerConn, int64_t, "RAILCC_IB_QPS_PER_CONNECTION", "NCCL_IB_QPS_PER_CONNECTION", "1", "1..16", \
    "Queue pairs per peer pair and NIC. Each is one channel: large messages are split across " \
    "them (NCCL's IB_SPLIT_DATA_ON_QPS=1).")                                                \
  X(ibRndvBytes, int64_t, "RAILCC_IB_RNDV_BYTES", "", "65536", "0..68719476736",                     \
    "Over verbs, messages of at least this many bytes whose receive copies (broadcast from "   \
    "its root, all-gather, all-to-all, send/recv) go by rendezvous: the receiver's NIC reads "  \
    "them straight from the sender's buffer into its destination (RDMA READ), no CPU copy on " \
    "either side; smaller ones, and reducing steps, go through the rings. 0: never.")        \
  X(ibMrCacheBytes, int64_t, "RAILCC_IB_MR_CACHE_BYTES", "", "1073741824", "0..1099511627776",        \
    "Most bytes of user memory (tensors) kept registered with each RDMA device for "         \
    "rendezvous, while their storage lives; beyond it the least recently used go. Pinned. "   \
    "0: register for each message.")                                                          \
  X(netGdrLevel, std::string, "RAILCC_NET_GDR_LEVEL", "NCCL_NET_GDR_LEVEL", "PXB", "LOC|PIX|PXB|PHB|SYS|0|1|2|3|4|5", \
    "Farthest GPU-NIC PCI path over which the NIC reads and writes GPU memory directly "    \
    "(GPUDirect RDMA); farther pairs stage through host memory.")                           \
  X(shmDisable, bool, "RAILCC_SHM_DISABLE", "NCCL_SHM_DISABLE", "0", "",                          \
    "1 sends same-host traffic over TCP instead of shared memory.")                          \
  X(topoFile, std::string, "RAILCC_TOPO_FILE", "", "", "",                                        \
    "An hwloc XML file (lstopo --of xml) read instead of this machine's topology, for VMs "    \
    "whose PCI tree is fake and for tests; also read by `railcc topo`.")                      \
  X(topoShareSec, int64_t, "RAILCC_TOPO_SHARE_SEC", "", "60", "0..86400",                      \
    "The ranks of one machine (and user) that start within this many seconds of each other " \
    "share one topology discovery: the first leaves it as hwloc XML in $TMPDIR (else /tmp), " \
    "railcc-topo-<uid>-<boot id>.xml, the rest load it in a fraction of the time. 0: every "  \
    "process discovers its own.")                                                            \
  X(topoDumpFile, std::string, "RAILCC_TOPO_DUMP_FILE", "", "", "",                               \
    "Where the first rank of each host writes the topology it used, as hwloc XML (%h is "     \
    "replaced by the host name). Not written where hwloc is missing (sysfs has no XML).")     \
  X(hwlocLib, std::string, "RAILCC_HWLOC_LIB", "", "", "",                                        \
    "The hwloc 2.x library to load at run time instead of libhwloc.so.15 (a path or a soname). " \
    "Without one the topology is read from sysfs, and the log and `railcc topo` say so.")     \
  X(hostId, std::string, "RAILCC_HOST_ID", "", "", "",                                            \
    "Overrides the host identity (boot id + network namespace) that decides which peers "     \
    "share memory.")                                                                          \
  X(authKeyFile, std::string, "RAILCC_AUTH_KEY_FILE", "", "", "",                                \
    "A file holding a key that every rank of the job has and the c10d store never sees (a "   \
    "Kubernetes secret, say): mixed into the TCP handshake, so a process that can read the "    \
    "store still cannot connect as a rank. Same file content on every rank.")                \
  X(initTimeoutSec, int64_t, "RAILCC_INIT_TIMEOUT", "", "300", "1..604800",                                \
    "Seconds that communicator set-up may take before it fails naming the missing ranks.")    \
  X(traceDir, std::string, "RAILCC_TRACE_DIR", "", "", "",                                        \
    "Directory for flight-recorder dumps (railcc-trace-<group>-rank<R>.json), written on any "  \
    "failure and by railcc.dump_trace(). Read them with `python -m railcc trace DIR`.")       \
  X(traceSize, int64_t, "RAILCC_TRACE_SIZE", "", "256", "1..1000000",                                       \
    "Ops the flight recorder keeps per communicator.")                                       \
  X(progressIntervalMs, int64_t, "RAILCC_PROGRESS_INTERVAL_MS", "", "1000", "0..3600000",                   \
    "How often each rank publishes its progress record (last op called, started, finished) "   \
    "through the store, from a watchdog thread. Timeouts use it to tell ranks that never "     \
    "called an op from ranks that froze, and a rank waiting on a peer it has no connection "    \
    "to yet judges that peer gone once its record has not changed for 10 of its intervals "     \
    "(2 s at least). 0 turns it off.")                                                        \
  X(stragglerAction, std::string, "RAILCC_STRAGGLER_ACTION", "", "warn", "warn|raise|off",                      \
    "warn: log a straggling rank or slow link once per episode; raise: also fail the next "    \
    "wait with railcc.StragglerError; off: do not check.")                                    \
  X(stragglerLagMs, int64_t, "RAILCC_STRAGGLER_LAG_MS", "", "50", "0..3600000",                             \
    "A rank whose mean arrival lag over the last RAILCC_STRAGGLER_WINDOW collectives exceeds " \
    "this (and 4x the median rank's) is a straggler.")                                        \
  X(stragglerLinkPct, int64_t, "RAILCC_STRAGGLER_LINK_PCT", "", "25", "0..100",                         \
    "A link (peer and direction) slower than this percentage of the median link of the same "  \
    "transport is slow. Only transfers of 256 KiB or more are timed.")                         \
  X(stragglerWindow, int64_t, "RAILCC_STRAGGLER_WINDOW", "", "32", "1..100000",                            \
    "Collectives (lag) and transfers per link (throughput) in the sliding window.")           \
  X(abortOnError, bool, "RAILCC_ABORT_ON_ERROR", "", "0", "",                                     \
    "1 tears the process down (SIGABRT, after the trace dump) when a communicator fails, as "  \
    "NCCL's watchdog does. By default the error is raised in Python instead.")               \
  X(spinUs, int64_t, "RAILCC_SPIN_US", "", "50", "0..1000000",                                              \
    "Microseconds a waiting thread (the progress thread, or a caller in wait()) polls before "  \
    "it sleeps on a futex, poll() or condition variable. Waiting on a peer, it spins in place "  \
    "for all of them where the host has a CPU for each of its ranks (unless that peer last "   \
    "waited on the same CPU); otherwise it "                                                    \
    "yields the CPU between polls, so ranks sharing cores still run. 0: sleep at once.")

/// Values of every parameter, read once when a communicator is made. Components receive a
/// Config; nothing below the glue calls getenv.
struct Config {
#define RAILCC_CONFIG_MEMBER(name, T, env, fallback, def, allowed, desc) T name{};
  RAILCC_PARAMS(RAILCC_CONFIG_MEMBER)
#undef RAILCC_CONFIG_MEMBER

  /// Defaults only, no environment.
  static Config defaults();
  /// Reads RAILCC_* then NCCL_* fallbacks. A value that does not parse or lies outside its
  /// allowed range throws Error(kInvalidUsage) naming the variable, the value and the range.
  static Config fromEnv();
};

struct ParamInfo {
  std::string name, env, fallback, type, defaultValue, allowed, description;
  std::string problem;  // why the variable's value is refused, or ""
  std::string value;   // effective value
  std::string source;  // which variable set it, or "default"
};

/// One row per parameter with its effective value: for `python -m railcc env` and docs/configuration.md.
std::vector<ParamInfo> describeParams();

}  // namespace railcc
