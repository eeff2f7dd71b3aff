//! `GET /metrics`: the server's counters in the Prometheus text format, kept with
//! `prometheus-client` (the Prometheus project's own Rust client). Counters and histograms
//! are updated where things happen (the engine thread for tokens and latencies, the HTTP side
//! for rejections); gauges (queue, slots) are read from [`super::scheduler::Shared`] when
//! scraped. Names follow Prometheus' conventions: a `lathe_` prefix, base units (seconds,
//! bytes), `_total` on counters.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// How a request ended: `stop`, `length` (finish reasons), `error`, `timeout`, `cancelled`
/// (the client left), `rejected` (an error answer before any generation: 4xx, 5xx).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

/// Which number of the device's memory: `model` (the weights uploaded), `heap` and `budget`
/// (what the backend reported when the device opened, `gpu::memory`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MemoryKind {
    pub kind: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<Outcome, Counter>,
    pub prompt_tokens: Counter,
    pub prompt_cached_tokens: Counter,
    pub prompt_cache_hits: Counter,
    pub generated_tokens: Counter,
    pub time_to_first_token: Histogram,
    pub time_per_token: Histogram,
    pub spec_drafted: Counter,
    pub spec_accepted: Counter,
    pub queue_depth: Gauge,
    pub active_slots: Gauge,
    pub slots: Gauge,
    pub gpu_memory: Family<MemoryKind, Gauge>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let mut r = Registry::with_prefix("lathe");
        let m = Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            prompt_cached_tokens: Counter::default(),
            prompt_cache_hits: Counter::default(),
            generated_tokens: Counter::default(),
            // 1 ms .. ~65 s: a first token on a CPU adapter can take tens of seconds.
            time_to_first_token: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            // 0.1 ms .. ~6.5 s per token.
            time_per_token: Histogram::new(exponential_buckets(0.0001, 2.0, 17)),
            spec_drafted: Counter::default(),
            spec_accepted: Counter::default(),
            queue_depth: Gauge::default(),
            active_slots: Gauge::default(),
            slots: Gauge::default(),
            gpu_memory: Family::default(),
        };
        r.register(
            "requests",
            "Requests by outcome: stop, length, error, timeout, cancelled, rejected",
            m.requests.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of finished requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "prompt_cached_tokens",
            "Prompt tokens served from a slot's prompt cache instead of prefilled",
            m.prompt_cached_tokens.clone(),
        );
        r.register(
            "prompt_cache_hits",
            "Requests that reused a slot's cached prefix",
            m.prompt_cache_hits.clone(),
        );
        r.register(
            "generated_tokens",
            "Tokens generated",
            m.generated_tokens.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "From a request's start in its slot to its first token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "time_per_output_token_seconds",
            "Between two consecutive tokens of a request",
            m.time_per_token.clone(),
        );
        r.register(
            "spec_drafted_tokens",
            "Speculative decoding: tokens drafted",
            m.spec_drafted.clone(),
        );
        r.register(
            "spec_accepted_tokens",
            "Speculative decoding: drafted tokens the target accepted",
            m.spec_accepted.clone(),
        );
        r.register(
            "queue_depth",
            "Requests waiting for a slot",
            m.queue_depth.clone(),
        );
        r.register(
            "active_slots",
            "Slots generating a request",
            m.active_slots.clone(),
        );
        r.register("slots", "Slots (--parallel)", m.slots.clone());
        r.register(
            "gpu_memory_bytes",
            "Device memory: model = weights uploaded; heap, budget = as the backend reported",
            m.gpu_memory.clone(),
        );
        Metrics { registry: r, ..m }
    }
}

impl Metrics {
    pub fn count(&self, outcome: &'static str) {
        self.requests.get_or_create(&Outcome { outcome }).inc();
    }

    /// The text exposition format (`text/plain; version=0.0.4` readers accept it too).
    pub fn encode(&self) -> String {
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}
