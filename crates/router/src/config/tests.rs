//! Tests of the configuration: parsing, defaults, and every check `validate` makes.

use super::*;
use std::time::Duration;
use tandem_core::WorkerId;

const GOOD: &str = "
listen: 127.0.0.1:8000
model: {served_name: smol}
prefill: [{id: p0, address: 'http://127.0.0.1:50061'}]
decode: [{id: d0, address: 'http://127.0.0.1:50062'}]
policy: {kind: round_robin}
timeouts: {connect: 500ms, request: 2m}
";

fn invalid(yaml: &str) -> String {
    match RouterConfig::from_yaml(yaml) {
        Err(Error::InvalidConfig(message)) => message,
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn parses_a_good_file() {
    let config = RouterConfig::from_yaml(GOOD).expect("valid");
    assert_eq!(config.listen, "127.0.0.1:8000".parse().expect("addr"));
    assert_eq!(config.prefill[0].id, WorkerId("p0".into()));
    assert_eq!(
        config.decode[0].address.to_string(),
        "http://127.0.0.1:50062"
    );
    assert_eq!(config.timeouts.connect, Duration::from_millis(500));
    assert_eq!(config.timeouts.request, Duration::from_secs(120));
    assert_eq!(config.timeouts.first_token, Duration::from_secs(60));
    assert_eq!(config.model.dir, None);
    let config = config.with_model_dir("/models/smol");
    assert_eq!(config.model.dir, Some(PathBuf::from("/models/smol")));
}

#[test]
fn unknown_keys_are_rejected() {
    let yaml = format!("{GOOD}extra: 1\n");
    assert!(matches!(
        RouterConfig::from_yaml(&yaml),
        Err(Error::ConfigParse(_))
    ));
    let yaml = GOOD.replace("round_robin", "random");
    assert!(matches!(
        RouterConfig::from_yaml(&yaml),
        Err(Error::ConfigParse(_))
    ));
    let yaml = GOOD.replace("500ms", "soon");
    assert!(matches!(
        RouterConfig::from_yaml(&yaml),
        Err(Error::ConfigParse(_))
    ));
}

#[test]
fn every_problem_is_reported() {
    let message = invalid(
        "
listen: localhost
model: {served_name: ''}
prefill: []
decode:
  - {id: d0, address: '127.0.0.1:50062'}
  - {id: d0, address: 'http://127.0.0.1:50063/x'}
  - {id: d2, address: 'http://127.0.0.1:50064'}
  - {id: d3, address: 'http://127.0.0.1:50064'}
timeouts: {connect: 0s}
",
    );
    for expected in [
        "listen",
        "served_name",
        "prefill: at least one worker",
        "must start with http://",
        "`d0` is used by another worker",
        "must not have a path",
        "listed twice",
        "timeouts.connect",
    ] {
        assert!(
            message.contains(expected),
            "{expected:?} not in {message:?}"
        );
    }
}

#[test]
fn aggregated_workers_alone_or_beside_pairs() {
    let agg = "listen: 127.0.0.1:8000\nmodel: {served_name: m}\naggregated: [{id: a0, address: 'http://127.0.0.1:50070'}]\n";
    let c = RouterConfig::from_yaml(agg).expect("aggregated workers alone");
    assert!(c.prefill.is_empty() && c.decode.is_empty() && c.aggregated.len() == 1);
    let half = format!("{agg}prefill: [{{id: p0, address: 'http://127.0.0.1:50061'}}]\n");
    assert!(invalid(&half).contains("decode: at least one worker"));
    let both = format!("{half}decode: [{{id: d0, address: 'http://127.0.0.1:50062'}}]\n");
    assert_eq!(
        RouterConfig::from_yaml(&both)
            .expect("pairs beside aggregated")
            .aggregated
            .len(),
        1
    );
    let none = "listen: 127.0.0.1:8000\nmodel: {served_name: m}\n";
    assert!(invalid(none).contains("prefill: at least one worker"));
    assert!(invalid(&both.replace("id: a0", "id: p0")).contains("aggregated[0].id `p0`"));
}

#[test]
fn discovery_alone_needs_no_static_workers_and_checks_its_endpoints() {
    let base = "listen: 127.0.0.1:8000\nmodel: {served_name: m}\n";
    let c = RouterConfig::from_yaml(&format!(
        "{base}discovery: {{etcd: {{endpoints: ['http://127.0.0.1:2379']}}}}\n"
    ))
    .expect("etcd discovery alone");
    let d = c.discovery.expect("discovery kept");
    assert_eq!(d.etcd.prefix, "/tandem", "default prefix");
    assert!(c.prefill.is_empty() && c.decode.is_empty());
    let message = invalid(&format!(
        "{base}discovery: {{etcd: {{endpoints: ['127.0.0.1:2379', 'http://h:1'], prefix: x}}}}\n"
    ));
    assert!(
        message.contains("discovery.etcd.endpoints: `127.0.0.1:2379`"),
        "{message}"
    );
    assert!(
        message.contains("prefix `x` must start with /"),
        "{message}"
    );
    let message = invalid(&format!("{base}discovery: {{etcd: {{endpoints: []}}}}\n"));
    assert!(message.contains("at least one URL"), "{message}");
}

#[test]
fn etcd_over_tls_takes_https_endpoints_a_ca_and_a_client_certificate_with_its_key() {
    let base = "listen: 127.0.0.1:8000\nmodel: {served_name: m}\n";
    let tls = "tls: {ca: /c/ca.crt, cert: /c/router.crt, key: /c/router.key}";
    let c = RouterConfig::from_yaml(&format!(
        "{base}discovery: {{etcd: {{endpoints: ['https://127.0.0.1:2379'], {tls}}}}}\n"
    ))
    .expect("etcd over TLS");
    let etcd = c
        .discovery
        .expect("discovery kept")
        .etcd
        .etcd_config(std::time::Duration::from_secs(10));
    etcd.check().expect("the discovery crate agrees");
    let tls = etcd.tls.expect("TLS kept");
    assert_eq!(tls.ca, std::path::Path::new("/c/ca.crt"));
    let id = tls.identity.expect("a client certificate");
    assert_eq!(
        (id.cert.to_str(), id.key.to_str()),
        (Some("/c/router.crt"), Some("/c/router.key"))
    );
    for (endpoint, tls, wanted) in [
        ("http://h:1", "tls: {ca: /c/ca.crt}", "must be https://"),
        ("https://h:1", "prefix: /t", "needs discovery.etcd.tls"),
        (
            "https://h:1",
            "tls: {ca: /c/ca.crt, cert: /c/r.crt}",
            "cert and key go together",
        ),
    ] {
        let message = invalid(&format!(
            "{base}discovery: {{etcd: {{endpoints: ['{endpoint}'], {tls}}}}}\n"
        ));
        assert!(message.contains(wanted), "{endpoint} {tls}: {message}");
    }
}

#[test]
fn the_retry_budget_defaults_to_three_and_is_bounded() {
    let c = RouterConfig::from_yaml(GOOD).expect("valid");
    assert_eq!(c.retry, RetryConfig::default());
    assert_eq!(c.retry.attempts, 3);
    let c = RouterConfig::from_yaml(&format!("{GOOD}retry: {{attempts: 8, backoff: 10ms}}\n"))
        .expect("valid");
    assert_eq!(
        (c.retry.attempts, c.retry.backoff),
        (8, Duration::from_millis(10))
    );
    let message = invalid(&format!("{GOOD}retry: {{attempts: 0}}\n"));
    assert!(
        message.contains("retry.attempts must be 1..=20, got 0"),
        "{message}"
    );
}

#[test]
fn the_breaker_defaults_to_three_failures_and_five_seconds_and_is_checked() {
    let c = RouterConfig::from_yaml(GOOD).expect("valid");
    assert_eq!(
        c.breaker.policy(),
        crate::pd::breaker::BreakerPolicy {
            threshold: 3,
            cooldown: Duration::from_secs(5)
        }
    );
    let c = RouterConfig::from_yaml(&format!("{GOOD}breaker: {{threshold: 5, cooldown: 1m}}\n"))
        .expect("valid");
    assert_eq!(
        (c.breaker.threshold, c.breaker.cooldown),
        (5, Duration::from_secs(60))
    );
    let message = invalid(&format!("{GOOD}breaker: {{threshold: 0, cooldown: 0s}}\n"));
    assert!(
        message.contains("breaker.threshold must be 1..=100, got 0")
            && message.contains("breaker.cooldown must be greater than zero"),
        "{message}"
    );
    let err = RouterConfig::from_yaml(&format!("{GOOD}breaker: {{treshold: 2}}\n"))
        .expect_err("a misspelt key is refused");
    assert!(format!("{err:?}").contains("treshold"), "{err:?}");
}

#[test]
fn every_policy_parses_and_unknown_ones_are_refused() {
    for (text, want) in [
        ("{kind: round_robin}", crate::pd::policy::Policy::RoundRobin),
        (
            "{kind: power_of_two}",
            crate::pd::policy::Policy::PowerOfTwo,
        ),
        (
            "{kind: cache_aware}",
            crate::pd::policy::Policy::CacheAware { balance: 8 },
        ),
        (
            "{kind: cache_aware, balance: 2}",
            crate::pd::policy::Policy::CacheAware { balance: 2 },
        ),
    ] {
        let yaml = GOOD.replace("policy: {kind: round_robin}", &format!("policy: {text}"));
        let c = RouterConfig::from_yaml(&yaml).expect(text);
        assert_eq!(c.policy.policy(), want, "{text}");
    }
    let bad = GOOD.replace("policy: {kind: round_robin}", "policy: {kind: random}");
    assert!(RouterConfig::from_yaml(&bad).is_err());
}

#[test]
fn admission_defaults_limit_nothing_and_its_limits_are_checked() {
    let c = RouterConfig::from_yaml(GOOD).expect("valid");
    assert_eq!(c.admission, AdmissionConfig::default());
    assert!(c.admission.max_running.is_none() && !c.admission.global.any());
    let keyed = format!(
        "{GOOD}auth: {{api_keys: ['sk-1 batch']}}\nadmission:\n  max_running: 8\n  \
             queue_timeout: 30s\n  global: {{tokens_per_second: 5000}}\n  \
             per_key: {{requests_per_second: 2, requests_burst: 4}}\n  \
             keys: {{batch: {{priority: 10, limits: {{requests_per_second: 0.5}}}}}}\n"
    );
    let c = RouterConfig::from_yaml(&keyed).expect("valid");
    let a = &c.admission;
    assert_eq!(
        (a.max_running, a.queue_timeout, a.queue_capacity),
        (Some(8), Duration::from_secs(30), DEFAULT_QUEUE_CAPACITY)
    );
    assert_eq!(a.global.tokens_per_second, Some(5000.0));
    let batch = a.keys["batch"];
    assert_eq!(batch.priority, Some(10));
    let effective = batch.limits.or(a.per_key);
    assert_eq!(
        (effective.requests_per_second, effective.requests_burst),
        (Some(0.5), None),
        "the key's own rate comes with its own burst"
    );
    let message = invalid(&format!(
            "{GOOD}admission:\n  max_running: 0\n  global: {{requests_per_second: 0, tokens_burst: 9}}\n  \
             per_key: {{requests_per_second: 1}}\n"
        ));
    for expected in [
        "admission.max_running must be at least 1",
        "admission.global.requests_per_second must be greater than zero",
        "admission.global.tokens_burst needs tokens_per_second",
        "need API keys",
    ] {
        assert!(
            message.contains(expected),
            "{expected:?} not in {message:?}"
        );
    }
    let err = RouterConfig::from_yaml(&format!("{GOOD}admission: {{max_runing: 2}}\n"))
        .expect_err("a misspelt key is refused");
    assert!(format!("{err:?}").contains("max_runing"), "{err:?}");
}

#[test]
fn health_ejects_after_three_failed_polls_by_default_and_is_checked() {
    let c = RouterConfig::from_yaml(GOOD).expect("valid");
    assert_eq!(
        (c.health.interval, c.health.eject_after),
        (Duration::from_secs(1), 3)
    );
    let c = RouterConfig::from_yaml(&format!(
        "{GOOD}health: {{interval: 250ms, eject_after: 5}}\n"
    ))
    .expect("valid");
    assert_eq!(
        (c.health.interval, c.health.eject_after),
        (Duration::from_millis(250), 5)
    );
    let message = invalid(&format!("{GOOD}health: {{interval: 0s, eject_after: 0}}\n"));
    assert!(
        message.contains("health.eject_after must be 1..=100, got 0")
            && message.contains("health.interval must be greater than zero"),
        "{message}"
    );
}

#[test]
fn tls_sections_load_their_files_and_worker_addresses_follow_worker_tls() {
    let dir = tempfile::tempdir().expect("tmp");
    let (ca, cert, key) = crate::tls::tests::issue(dir.path(), "router");
    let (ca, cert, key) = (ca.display(), cert.display(), key.display());
    let tls = format!(
            "tls: {{cert: '{cert}', key: '{key}', client_ca: '{ca}'}}\n\
             worker_tls: {{ca: '{ca}', cert: '{cert}', key: '{key}', server_name: tandem-worker}}\n"
        );
    let https = GOOD.replace("http://", "https://");
    let c = RouterConfig::from_yaml(&format!("{https}{tls}")).expect("valid");
    let front = c.tls.expect("tls kept");
    assert_eq!(front.cert.display().to_string(), cert.to_string());
    assert_eq!(
        front.client_ca.map(|p| p.display().to_string()),
        Some(ca.to_string())
    );
    let workers = c.worker_tls.expect("worker_tls kept");
    assert_eq!(workers.server_name.as_deref(), Some("tandem-worker"));
    let plain = RouterConfig::from_yaml(GOOD).expect("valid");
    assert!(
        plain.tls.is_none() && plain.worker_tls.is_none(),
        "plain HTTP by default"
    );

    let message = invalid(&format!("{GOOD}{tls}"));
    assert!(
        message.contains(
            "prefill[0].address http://127.0.0.1:50061: workers are reached over mutual TLS"
        ) && message.contains("decode[0].address"),
        "{message}"
    );
    let message = invalid(&https);
    assert!(message.contains("needs a worker_tls section"), "{message}");
    let missing = dir.path().join("gone.crt");
    let message = invalid(&format!(
        "{GOOD}tls: {{cert: '{}', key: '{key}'}}\n",
        missing.display()
    ));
    assert!(
        message.contains("tls: ") && message.contains("gone.crt"),
        "{message}"
    );
    let message = invalid(&format!(
        "{https}worker_tls: {{ca: '{key}', cert: '{cert}', key: '{key}'}}\n"
    ));
    assert!(
        message.contains("worker_tls: ") && message.contains("router.key"),
        "{message}"
    );
    let err = RouterConfig::from_yaml(&format!("{GOOD}tls: {{cert: a, key: b, ca: c}}\n"))
        .expect_err("a misspelt key is refused");
    assert!(format!("{err:?}").contains("unknown field `ca`"), "{err:?}");
}

#[test]
fn ids_are_unique_across_roles() {
    let message = invalid(&GOOD.replace("id: d0", "id: p0"));
    assert!(message.contains("decode[0].id `p0`"), "{message}");
}
