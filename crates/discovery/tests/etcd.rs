//! Discovery and registration against a real etcd server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;
use tandem_discovery::local::LocalEtcd as Etcd;
use tandem_discovery::{
    ClientIdentity, Discovery, EtcdConfig, EtcdDiscovery, EtcdTls, Registration, WorkerRecord,
    WorkerRole, WorkerSet, WorkerState,
};
use tokio::sync::watch;

fn config(etcd: &Etcd, ttl: u64) -> EtcdConfig {
    EtcdConfig::from_url(&etcd.url(), "/test", Duration::from_secs(ttl)).unwrap()
}

fn record(id: &str, role: WorkerRole) -> WorkerRecord {
    WorkerRecord {
        id: id.into(),
        role,
        address: format!("http://127.0.0.1:9/{id}"),
        layout: "tp1 dp1 ep1".into(),
        model_id: "00ff".into(),
        capacity: 64,
        state: WorkerState::Active,
    }
}

/// Waits (up to 30 s) until the set satisfies `pred`; returns that set.
async fn until(
    rx: &mut watch::Receiver<WorkerSet>,
    what: &str,
    pred: impl FnMut(&WorkerSet) -> bool,
) -> WorkerSet {
    tokio::time::timeout(Duration::from_secs(30), rx.wait_for(pred))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for: {what}"))
        .expect("discovery task alive")
        .clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn workers_appear_change_state_and_disappear_as_they_register_drain_and_leave() {
    let etcd = Etcd::start();
    let discovery = EtcdDiscovery::start(config(&etcd, 10)).unwrap();
    let mut rx = discovery.subscribe();
    let p = Registration::start(config(&etcd, 10), record("p0", WorkerRole::Prefill))
        .await
        .unwrap();
    let d = Registration::start(config(&etcd, 10), record("d0", WorkerRole::Decode))
        .await
        .unwrap();
    let set = until(&mut rx, "both registered", |s| s.workers.len() == 2).await;
    assert_eq!(set.workers["p0"], record("p0", WorkerRole::Prefill));
    assert_eq!(set.of_role(WorkerRole::Decode).count(), 1);
    assert!(*p.registered().borrow());

    d.set_state(WorkerState::Draining);
    until(&mut rx, "d0 draining", |s| {
        s.workers
            .get("d0")
            .is_some_and(|w| w.state == WorkerState::Draining)
    })
    .await;
    d.deregister().await;
    let set = until(&mut rx, "d0 gone", |s| !s.workers.contains_key("d0")).await;
    assert!(set.workers.contains_key("p0"), "the other worker stays");

    // A second watcher started now lists what is there.
    let late = EtcdDiscovery::start(config(&etcd, 10)).unwrap();
    let mut late_rx = late.subscribe();
    until(&mut late_rx, "the late watcher lists p0", |s| {
        s.workers.len() == 1 && s.workers.contains_key("p0")
    })
    .await;
    drop(p);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_that_stops_renewing_its_lease_disappears_after_the_ttl() {
    let etcd = Etcd::start();
    let discovery = EtcdDiscovery::start(config(&etcd, 10)).unwrap();
    let mut rx = discovery.subscribe();
    let r = Registration::start(config(&etcd, 2), record("d1", WorkerRole::Decode))
        .await
        .unwrap();
    until(&mut rx, "d1 registered", |s| s.workers.contains_key("d1")).await;
    // Dropped without deregistering: what a killed process leaves behind.
    drop(r);
    until(&mut rx, "d1 expired", |s| !s.workers.contains_key("d1")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_revoked_lease_is_noticed_and_the_worker_registers_again() {
    let etcd = Etcd::start();
    let discovery = EtcdDiscovery::start(config(&etcd, 10)).unwrap();
    let mut rx = discovery.subscribe();
    let r = Registration::start(config(&etcd, 2), record("p1", WorkerRole::Prefill))
        .await
        .unwrap();
    until(&mut rx, "p1 registered", |s| s.workers.contains_key("p1")).await;
    // An operator (or an expiry) removes the lease behind the worker's back.
    let mut admin = etcd_client::Client::connect([etcd.url()], None)
        .await
        .unwrap();
    let leases = admin.leases().await.unwrap();
    assert_eq!(leases.leases().len(), 1, "one lease, the worker's");
    let revoked = admin
        .lease_revoke(leases.leases()[0].id())
        .await
        .unwrap()
        .header()
        .expect("a header")
        .revision();
    until(&mut rx, "p1 registered again after the revoke", |s| {
        s.revision > revoked && s.workers.contains_key("p1")
    })
    .await;
    let mut up = r.registered();
    tokio::time::timeout(Duration::from_secs(30), up.wait_for(|v| *v))
        .await
        .expect("registered again")
        .expect("task alive");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_watch_lists_again_after_etcd_restarts() {
    let mut etcd = Etcd::start();
    let discovery = EtcdDiscovery::start(config(&etcd, 10)).unwrap();
    let mut rx = discovery.subscribe();
    let a = Registration::start(config(&etcd, 10), record("a", WorkerRole::Both))
        .await
        .unwrap();
    until(&mut rx, "a registered", |s| s.workers.contains_key("a")).await;
    etcd.restart();
    // Registered after the restart: only a watch re-established on the new server sees it.
    let b = Registration::start(config(&etcd, 10), record("b", WorkerRole::Both))
        .await
        .unwrap();
    let set = until(&mut rx, "b seen after the restart", |s| {
        s.workers.contains_key("b")
    })
    .await;
    assert!(
        set.workers.contains_key("a"),
        "a's lease survived the restart"
    );
    assert!(*a.registered().borrow());
    drop(b);
}

/// A throwaway CA in `dir` (`NAME-ca.crt`) and, per leaf name, a certificate for 127.0.0.1
/// signed by it (`LEAF.crt`, `LEAF.key`), usable as a server and a client certificate.
fn issue(dir: &std::path::Path, name: &str, leaves: &[&str]) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    std::fs::write(
        dir.join(format!("{name}-ca.crt")),
        ca.self_signed(&ca_key).unwrap().pem(),
    )
    .unwrap();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    for leaf in leaves {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
                .unwrap();
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("{leaf}.crt")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{leaf}.key")), key.serialize_pem()).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn over_tls_a_client_certificate_from_the_ca_is_served_and_any_other_client_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    issue(d, "cluster", &["etcd", "router", "worker"]);
    issue(d, "other", &["stranger"]);
    let etcd = Etcd::start_tls(tandem_discovery::local::ServerTls {
        cert: d.join("etcd.crt"),
        key: d.join("etcd.key"),
        client_ca: d.join("cluster-ca.crt"),
    });
    assert!(etcd.url().starts_with("https://"), "{}", etcd.url());
    let plain = EtcdConfig::from_url(
        &etcd.url().replace("https", "http"),
        "/tls",
        Duration::from_secs(10),
    )
    .unwrap();
    let as_client = |cert: Option<&str>| {
        plain.clone().with_tls(EtcdTls {
            ca: d.join("cluster-ca.crt"),
            identity: cert.map(|c| ClientIdentity {
                cert: d.join(format!("{c}.crt")),
                key: d.join(format!("{c}.key")),
            }),
        })
    };

    let discovery = EtcdDiscovery::start(as_client(Some("router"))).unwrap();
    let mut rx = discovery.subscribe();
    let registered =
        Registration::start(as_client(Some("worker")), record("p0", WorkerRole::Prefill))
            .await
            .expect("a worker with a certificate from the cluster's CA registers");
    let set = until(&mut rx, "p0 seen over TLS", |s| {
        s.workers.contains_key("p0")
    })
    .await;
    assert_eq!(set.workers["p0"], record("p0", WorkerRole::Prefill));

    // Refused: no client certificate, one from another CA, and plain text to the TLS port.
    let stranger = plain.clone().with_tls(EtcdTls {
        ca: d.join("cluster-ca.crt"),
        identity: Some(ClientIdentity {
            cert: d.join("stranger.crt"),
            key: d.join("stranger.key"),
        }),
    });
    for (who, config) in [
        ("no client certificate", as_client(None)),
        ("a certificate from another CA", stranger),
        ("plain text", plain.clone()),
    ] {
        let attempt = tokio::time::timeout(
            Duration::from_secs(30),
            Registration::start(config, record("intruder", WorkerRole::Decode)),
        )
        .await
        .unwrap_or_else(|_| panic!("{who}: neither registered nor refused within 30 s"));
        let e = attempt.expect_err(who);
        assert!(
            matches!(e, tandem_discovery::Error::Etcd { .. }),
            "{who}: {e}"
        );
    }
    // A missing certificate file is named.
    let missing = as_client(Some("nobody"));
    let e = Registration::start(missing, record("x", WorkerRole::Decode))
        .await
        .expect_err("no such file");
    assert!(e.to_string().contains("nobody.crt"), "{e}");

    // The intruders left nothing: the watcher still lists only p0.
    let listed = EtcdDiscovery::start(as_client(Some("router"))).unwrap();
    let mut rx = listed.subscribe();
    let set = until(&mut rx, "a fresh list", |s| s.revision > 0).await;
    assert_eq!(set.workers.keys().collect::<Vec<_>>(), ["p0"]);
    drop(registered);
}
