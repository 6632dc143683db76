// The ranges every number read from a file or a flag must fall in, checked once where it enters
// (JsonReader::NumberIn, CheckFlagRange), so that no later product wraps, no rate divides into
// inf, and no duration leaves the simulator's int64 nanosecond clock. The bounds are far outside
// any real hardware or model; each names what it is measured against.
#pragma once

#include <cstdint>

namespace fsdp {

/// An inclusive range of a quantity in `unit`.
struct NumberRange {
  double min = 0, max = 0;
  const char* unit = "";
};

namespace limits {

/// GPU memory: 1 MiB .. 1 PiB (the largest card today, B200, has 192 GB: NVIDIA datasheet).
inline constexpr NumberRange kDeviceBytes{1 << 20, 1125899906842624.0, "bytes"};
/// Fixed reservations (CUDA context, NCCL buffers, cuBLAS workspace): 0 .. 1 PiB.
inline constexpr NumberRange kOverheadBytes{0, 1125899906842624.0, "bytes"};
/// Dense FLOP/s: 1 GFLOP/s (one CPU core) .. 1e18 (B200's sparse FP4 is 2e16: NVIDIA datasheet).
inline constexpr NumberRange kFlopsPerS{1e9, 1e18, "FLOP/s"};
/// Memory, link and PCIe bandwidth: 1 MB/s .. 1 PB/s (HBM3e is 8 TB/s, NVLink 5 1.8 TB/s).
inline constexpr NumberRange kBytesPerS{1e6, 1e15, "bytes/s"};
/// A link's or launch's latency: 0 .. 1 s (InfiniBand is ~1e-6 s).
inline constexpr NumberRange kLatencyS{0, 1, "s"};
/// A share of a peak (efficiencies): (0, 1].
inline constexpr NumberRange kShare{1e-6, 1, ""};
/// A GPU-hour's price: 0 .. 1e6 USD.
inline constexpr NumberRange kUsdPerGpuHour{0, 1e6, "USD per GPU-hour"};
/// A measured collective's time: 1 ns .. 1e6 s.
inline constexpr NumberRange kMeasuredSeconds{1e-9, 1e6, "s"};

/// GPUs in a job (a cluster's nodes x GPUs per node too): today's largest runs use ~1e5.
inline constexpr int64_t kMaxGpus = 1'000'000;
/// Parameter tensors of a model, counted before they are built: DeepSeek-V3 has ~92k (61 layers x
/// 256 experts x 3 + attention), a 4,096-expert x 10,000-layer config would have 123 million.
inline constexpr double kMaxTensors = 1e6;
/// Parameters of a model: 1e15 (2,500 x Llama 3.1 405B); every byte count of it stays in int64.
inline constexpr double kMaxParams = 1e15;
/// Simulated time of one step with every operation end to end: 1e8 s (3 years), far inside the
/// simulator's int64 nanosecond clock (9.2e9 s).
inline constexpr double kMaxSimulatedSeconds = 1e8;

/// Schedule actions fsdp-sim plays, over all micro-batches and simulated ranks: each costs ~180
/// bytes of events, ops and records and ~0.4 us (tiny-llama with 10,000 micro-batches: 950k
/// actions, 165 MB, 0.36 s), so 1e7 keep a run under ~2 GB and ~5 s. Steps beyond that are the
/// planner's job: fsdp-plan replays repeated micro-batches once.
inline constexpr double kMaxSimulatedActions = 1e7;

}  // namespace limits
}  // namespace fsdp
