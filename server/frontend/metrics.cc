#include "metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

#ifdef ATTND_HAVE_METRICS
#include <exception>

#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#endif

namespace attnd::server {

#ifdef ATTND_HAVE_METRICS
namespace {

// 50 us .. 60 s: a small decode step on the GPU is tens of microseconds, a large CPU-backend call seconds.
const prometheus::Histogram::BucketBoundaries& DurationBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{
      0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  return *b;
}

prometheus::MetricFamily Family(const char* name, const char* help, prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

prometheus::ClientMetric Value(prometheus::MetricType type, double v, std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = v;
  } else {
    m.gauge.value = v;
  }
  return m;
}

// The backend's own numbers, read when scraped (they already live in the backend; copying them into
// registry gauges on a timer would only make them stale).
class BackendCollector final : public prometheus::Collectable {
 public:
  BackendCollector(const Backend* backend, std::function<uint32_t()> streams_receiving,
                   std::function<SequenceCounts()> sequences)
      : backend_(backend), streams_receiving_(std::move(streams_receiving)), sequences_(std::move(sequences)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    std::vector<prometheus::MetricFamily> out;
    auto in_flight = Family("attnd_in_flight", "Forward requests accepted by the backend and not finished yet.",
                            MetricType::Gauge);
    in_flight.metric.push_back(Value(MetricType::Gauge, backend_->in_flight()));
    out.push_back(std::move(in_flight));
    auto queue = Family("attnd_queue_depth", "Forward requests queued and not started yet.", MetricType::Gauge);
    queue.metric.push_back(Value(MetricType::Gauge, backend_->queue_depth()));
    out.push_back(std::move(queue));
    auto max_queue = Family("attnd_queue_capacity", "Queued requests beyond which Forward answers RESOURCE_EXHAUSTED.",
                            MetricType::Gauge);
    max_queue.metric.push_back(Value(MetricType::Gauge, backend_->max_queue()));
    out.push_back(std::move(max_queue));
    if (streams_receiving_) {
      auto receiving = Family("attnd_streams_receiving",
                              "ForwardStream calls past their header whose inputs are still arriving (on the cuda "
                              "backend each holds its device memory already).",
                              MetricType::Gauge);
      receiving.metric.push_back(Value(MetricType::Gauge, streams_receiving_()));
      out.push_back(std::move(receiving));
    }

    const BackendStats s = backend_->stats();
    auto hits = Family("attnd_tensor_map_cache_hits_total", "Forward requests whose TMA tensor maps were cached.",
                       MetricType::Counter);
    hits.metric.push_back(Value(MetricType::Counter, static_cast<double>(s.tensor_map_cache_hits)));
    out.push_back(std::move(hits));
    auto misses = Family("attnd_tensor_map_cache_misses_total",
                         "Forward requests whose TMA tensor maps had to be encoded.", MetricType::Counter);
    misses.metric.push_back(Value(MetricType::Counter, static_cast<double>(s.tensor_map_cache_misses)));
    out.push_back(std::move(misses));
    auto memory = Family("attnd_device_memory_used_bytes", "Device memory held by this server, per CUDA device.",
                         MetricType::Gauge);
    for (const DeviceMemoryUse& d : backend_->device_memory()) {
      memory.metric.push_back(
          Value(MetricType::Gauge, static_cast<double>(d.used_bytes), {{"device", absl::StrCat(d.device)}}));
    }
    out.push_back(std::move(memory));
    if (sequences_) {
      const SequenceCounts q = sequences_();
      auto open = Family("attnd_sequences_open", "KV sequences open now.", MetricType::Gauge);
      open.metric.push_back(Value(MetricType::Gauge, static_cast<double>(q.open)));
      out.push_back(std::move(open));
      auto pages = Family("attnd_kv_pages", "Pages of the KV pools, by state (used: held by a sequence).",
                          MetricType::Gauge);
      pages.metric.push_back(Value(MetricType::Gauge, static_cast<double>(q.pages_used), {{"state", "used"}}));
      pages.metric.push_back(Value(MetricType::Gauge, static_cast<double>(q.pages_free), {{"state", "free"}}));
      out.push_back(std::move(pages));
      auto expired = Family("attnd_sequences_expired_total", "KV sequences closed by --sequence_ttl_s.",
                            MetricType::Counter);
      expired.metric.push_back(Value(MetricType::Counter, static_cast<double>(q.expired)));
      out.push_back(std::move(expired));
    }
    return out;
  }

 private:
  const Backend* const backend_;
  const std::function<uint32_t()> streams_receiving_;
  const std::function<SequenceCounts()> sequences_;
};

// The family `name` of this registry, from a prometheus::Build* builder.
template <typename Builder>
auto& Registered(Builder builder, prometheus::Registry& registry, const char* name, const char* help) {
  return builder.Name(name).Help(help).Register(registry);
}

// 1 .. 256 sequences per launch (--max_step_batch's default).
const prometheus::Histogram::BucketBoundaries& BatchBuckets() {
  static const auto* b = new prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128, 256};
  return *b;
}

}  // namespace

struct ServerMetrics::Impl {
  Impl(const Backend* backend, std::function<uint32_t()> streams_receiving,
       std::function<SequenceCounts()> sequences)
      : registry(std::make_shared<prometheus::Registry>()),
        backend_collector(
            std::make_shared<BackendCollector>(backend, std::move(streams_receiving), std::move(sequences))),
        requests(Registered(prometheus::BuildCounter(), *registry, "attnd_requests_total",
                            "RPCs finished, by method and gRPC status code.")),
        durations(Registered(prometheus::BuildHistogram(), *registry, "attnd_request_duration_seconds",
                             "RPC latency by phase: queue (accepted until a worker took it) and kernel (the attention "
                             "computation) from the backend's timing, total (call start to status) for every RPC.")),
        bytes_in(Registered(prometheus::BuildCounter(), *registry, "attnd_bytes_received_total",
                            "Request message bytes received by Forward and ForwardStream.")),
        bytes_out(Registered(prometheus::BuildCounter(), *registry, "attnd_bytes_sent_total",
                             "Reply message bytes sent by Forward and ForwardStream.")),
        step_batch(Registered(prometheus::BuildHistogram(), *registry, "attnd_step_batch_sequences",
                              "Sequences in the launch each Step ran in (its own included).")
                       .Add({}, BatchBuckets())),
        auth_failures(Registered(prometheus::BuildCounter(), *registry, "attnd_auth_failures_total",
                                 "Calls refused UNAUTHENTICATED by the bearer-token check.")
                          .Add({})),
        connections_refused(Registered(prometheus::BuildCounter(), *registry, "attnd_connections_refused_total",
                                       "gRPC connections closed at accept: over --max_connections, or shed at the "
                                       "descriptor limit.")
                                .Add({})),
        listener_up(Registered(prometheus::BuildGauge(), *registry, "attnd_listener_up",
                               "1 while every gRPC listener accepts connections; 0 once one stopped for good.")
                        .Add({})) {
    listener_up.Set(1);
    // The data-plane series exist from the start, so that rate() and absent() work before the first call.
    for (const char* m : {"Forward", "ForwardStream", "Step", "StepStream"}) {
      requests.Add({{"method", m}, {"code", "OK"}});
      bytes_in.Add({{"method", m}});
      bytes_out.Add({{"method", m}});
      for (const char* phase : {"queue", "kernel", "total"}) {
        durations.Add({{"method", m}, {"phase", phase}}, DurationBuckets());
      }
    }
  }

  std::shared_ptr<prometheus::Registry> registry;
  std::shared_ptr<BackendCollector> backend_collector;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Family<prometheus::Histogram>& durations;
  prometheus::Family<prometheus::Counter>& bytes_in;
  prometheus::Family<prometheus::Counter>& bytes_out;
  prometheus::Histogram& step_batch;
  prometheus::Counter& auth_failures;
  prometheus::Counter& connections_refused;
  prometheus::Gauge& listener_up;
  absl::Mutex exposer_mu;
  std::unique_ptr<prometheus::Exposer> exposer ABSL_GUARDED_BY(exposer_mu);
};

ServerMetrics::ServerMetrics(const Backend* backend, std::function<uint32_t()> streams_receiving,
                             std::function<SequenceCounts()> sequences)
    : impl_(std::make_unique<Impl>(backend, std::move(streams_receiving), std::move(sequences))) {}

ServerMetrics::~ServerMetrics() {
  // The HTTP threads may be inside Collect(): stop them before the collectables go.
  absl::MutexLock lock(&impl_->exposer_mu);
  impl_->exposer.reset();
}

bool ServerMetrics::Available() { return true; }

void ServerMetrics::RecordCall(const CallRecord& call) {
  impl_->requests.Add({{"method", call.method}, {"code", absl::StatusCodeToString(call.code)}}).Increment();
  impl_->durations.Add({{"method", call.method}, {"phase", "total"}}, DurationBuckets())
      .Observe(absl::ToDoubleSeconds(call.total));
  if (call.queue) {
    impl_->durations.Add({{"method", call.method}, {"phase", "queue"}}, DurationBuckets())
        .Observe(absl::ToDoubleSeconds(*call.queue));
  }
  if (call.kernel) {
    impl_->durations.Add({{"method", call.method}, {"phase", "kernel"}}, DurationBuckets())
        .Observe(absl::ToDoubleSeconds(*call.kernel));
  }
  if (call.bytes_in > 0) impl_->bytes_in.Add({{"method", call.method}}).Increment(static_cast<double>(call.bytes_in));
  if (call.bytes_out > 0) impl_->bytes_out.Add({{"method", call.method}}).Increment(static_cast<double>(call.bytes_out));
}

void ServerMetrics::RecordStep(uint32_t batch_sequences) { impl_->step_batch.Observe(batch_sequences); }

void ServerMetrics::RecordAuthFailure() { impl_->auth_failures.Increment(); }
void ServerMetrics::RecordConnectionRefused() { impl_->connections_refused.Increment(); }
void ServerMetrics::RecordListenerLost() { impl_->listener_up.Set(0); }

std::string ServerMetrics::Scrape() const {
  std::vector<prometheus::MetricFamily> families = impl_->registry->Collect();
  for (prometheus::MetricFamily& f : impl_->backend_collector->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

absl::Status ServerMetrics::Serve(const std::string& listen) {
  absl::MutexLock lock(&impl_->exposer_mu);
  if (impl_->exposer != nullptr) return absl::FailedPreconditionError("metrics_listen: the endpoint is already up");
  try {
    // civetweb takes "host:port"; two threads: scrapes are rare and cheap.
    impl_->exposer = std::make_unique<prometheus::Exposer>(listen, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("metrics_listen: cannot serve HTTP on '", listen, "': ", e.what()));
  }
  impl_->exposer->RegisterCollectable(impl_->registry);
  impl_->exposer->RegisterCollectable(impl_->backend_collector);
  return absl::OkStatus();
}

int ServerMetrics::port() const {
  absl::MutexLock lock(&impl_->exposer_mu);
  if (impl_->exposer == nullptr) return 0;
  const std::vector<int> ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

#else  // !ATTND_HAVE_METRICS

struct ServerMetrics::Impl {};
ServerMetrics::ServerMetrics(const Backend*, std::function<uint32_t()>, std::function<SequenceCounts()>) {}
ServerMetrics::~ServerMetrics() = default;
bool ServerMetrics::Available() { return false; }
void ServerMetrics::RecordCall(const CallRecord&) {}
void ServerMetrics::RecordStep(uint32_t) {}
void ServerMetrics::RecordAuthFailure() {}
void ServerMetrics::RecordConnectionRefused() {}
void ServerMetrics::RecordListenerLost() {}
std::string ServerMetrics::Scrape() const { return ""; }
absl::Status ServerMetrics::Serve(const std::string& listen) {
  return absl::UnimplementedError(absl::StrCat(
      "metrics_listen: this attnd was built without prometheus-cpp (the static build); cannot serve '", listen, "'"));
}
int ServerMetrics::port() const { return 0; }

#endif

}  // namespace attnd::server
