//! TLS end to end: a router serving HTTPS and reaching its workers over mutual TLS, with
//! certificates from `tandem tls generate`. A client without a certificate, one whose
//! certificate comes from another CA, and a plain-text connection are refused by a worker; a
//! certificate from the right CA naming the wrong role is refused per call; the router's HTTPS
//! certificate and a worker's gRPC certificate are rotated by rewriting their files, without a
//! restart.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::json;
use std::path::Path;
use std::time::Duration;
use tandem_e2e::{generate_certs, post, rt, Cluster, ClusterOptions};
use tandem_proto::v1 as pb;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// A TLS client config trusting `ca_dir`'s CA, presenting `identity` (`NAME` in `id_dir`).
fn tls(ca_dir: &Path, identity: Option<(&Path, &str)>) -> ClientTlsConfig {
    let read = |p: std::path::PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    let mut config =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca_dir.join("ca.crt"))));
    if let Some((dir, name)) = identity {
        config = config.identity(Identity::from_pem(
            read(dir.join(format!("{name}.crt"))),
            read(dir.join(format!("{name}.key"))),
        ));
    }
    config
}

/// A worker client over `tls` (plain text when `None`) to `address`.
async fn client(
    address: &str,
    tls: Option<ClientTlsConfig>,
) -> Result<pb::worker_client::WorkerClient<tonic::transport::Channel>, String> {
    let mut endpoint = Endpoint::from_shared(address.to_string())
        .expect("an address")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    if let Some(t) = tls {
        endpoint = endpoint.tls_config(t).expect("a TLS config");
    }
    let channel = tokio::time::timeout(Duration::from_secs(10), endpoint.connect())
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| format!("connect: {e:?}"))?;
    Ok(pb::worker_client::WorkerClient::new(channel))
}

/// `Stats` through `tls` on `address`: the answer, or why there was none.
async fn stats(address: &str, tls: Option<ClientTlsConfig>) -> Result<pb::StatsResponse, String> {
    let mut c = client(address, tls).await?;
    c.stats(pb::StatsRequest::default())
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

#[test]
fn a_cluster_with_mutual_tls_answers_over_https_and_its_workers_refuse_peers_without_a_valid_certificate(
) {
    let cluster = Cluster::start(ClusterOptions {
        tls: true,
        ..ClusterOptions::default()
    });
    let certs = cluster.tls_dir.clone().expect("certificates");
    let other = tempfile::tempdir().unwrap();
    generate_certs(other.path(), None, &["router", "admin"]);
    let (url, prefill) = (cluster.url.clone(), cluster.prefill_addr.clone());
    assert!(url.starts_with("https://") && prefill.starts_with("https://"));
    rt().block_on(async {
        let https = cluster.https_client();
        let (status, body) = post(
            &https,
            &format!("{url}/v1/chat/completions"),
            json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                   "max_tokens": 8, "temperature": 0}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let text = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default();
        assert!(text.contains("Paris"), "{body}");
        let plain = reqwest::Client::new()
            .get(format!("{}/health", url.replace("https://", "http://")))
            .send()
            .await;
        assert!(
            plain.is_err(),
            "plain HTTP to the HTTPS port must not be answered: {plain:?}"
        );

        // The router's own certificate from the right CA is let in: the refusals below are
        // about the certificates, not the worker.
        let ok = stats(&prefill, Some(tls(&certs, Some((&certs, "router"))))).await;
        assert_eq!(
            ok.expect("the router's certificate is accepted").role,
            "prefill"
        );
        let admin = stats(&prefill, Some(tls(&certs, Some((&certs, "admin"))))).await;
        assert!(admin.is_ok(), "an admin may read stats: {admin:?}");

        let refused = [
            (
                "no client certificate",
                stats(&prefill, Some(tls(&certs, None))).await,
            ),
            (
                "a certificate from another CA",
                stats(&prefill, Some(tls(&certs, Some((other.path(), "router"))))).await,
            ),
            (
                "plain text",
                stats(&prefill.replace("https://", "http://"), None).await,
            ),
        ];
        for (what, outcome) in refused {
            assert!(outcome.is_err(), "{what}: answered {outcome:?}");
        }

        // Valid certificates whose roles the call does not allow.
        let mut as_admin = client(&prefill, Some(tls(&certs, Some((&certs, "admin")))))
            .await
            .expect("connects");
        let denied = as_admin
            .prefill(pb::PrefillRequest::default())
            .await
            .expect_err("an admin may not prefill");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
        let mut as_worker = client(&prefill, Some(tls(&certs, Some((&certs, "decode")))))
            .await
            .expect("connects");
        let denied = as_worker
            .stats(pb::StatsRequest::default())
            .await
            .expect_err("a decode worker may not read stats");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
        let mut as_router = client(&prefill, Some(tls(&certs, Some((&certs, "router")))))
            .await
            .expect("connects");
        let denied = as_router
            .drain(pb::DrainRequest::default())
            .await
            .expect_err("the router may not drain a worker");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    });
    assert!(
        cluster.wait_log("prefill", "call refused", Duration::from_secs(10)),
        "the worker logs refused calls\n{}",
        cluster.log("prefill")
    );
}

/// The leaf certificate (DER) the router presents to a new connection.
async fn served_certificate(cluster: &Cluster) -> Vec<u8> {
    let resp = cluster
        .https_client()
        .get(format!("{}/health", cluster.url))
        .send()
        .await
        .expect("an HTTPS answer");
    assert_eq!(resp.status(), 200);
    resp.extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|i| i.peer_certificate())
        .expect("the peer's certificate")
        .to_vec()
}

fn first_der(pem: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_file(pem)
        .expect("a PEM certificate")
        .to_vec()
}

/// Writes `name`'s certificate and key from `from` over those in `to`, as a rotation writes
/// them: the certificate first, then its key.
fn install(from: &Path, to: &Path, name: &str) {
    for file in [format!("{name}.crt"), format!("{name}.key")] {
        std::fs::copy(from.join(&file), to.join(&file)).unwrap();
    }
}

/// A completion through the router's HTTPS front answers 200.
async fn assert_completes(cluster: &Cluster) {
    let (status, body) = post(
        &cluster.https_client(),
        &format!("{}/v1/completions", cluster.url),
        json!({"prompt": "hello", "max_tokens": 4, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// A TLS cluster of synthetic engines, and a new certificate for its component `name` from
/// the same CA written beside (not over) the served one: (cluster, its certificate directory,
/// the new files' directory, the served leaf, the new leaf), the leaves as DER.
fn rotation_of(
    name: &str,
) -> (
    Cluster,
    std::path::PathBuf,
    tempfile::TempDir,
    Vec<u8>,
    Vec<u8>,
) {
    let synthetic = vec!["--engine".to_string(), "synthetic".to_string()];
    let cluster = Cluster::start(ClusterOptions {
        tls: true,
        prefill_args: synthetic.clone(),
        decode_args: synthetic,
        ..ClusterOptions::default()
    });
    let certs = cluster.tls_dir.clone().expect("certificates");
    let rotated = tempfile::tempdir().unwrap();
    generate_certs(rotated.path(), Some(&certs), &[name]);
    let (old, new) = (
        first_der(&certs.join(format!("{name}.crt"))),
        first_der(&rotated.path().join(format!("{name}.crt"))),
    );
    assert_ne!(old, new);
    (cluster, certs, rotated, old, new)
}

#[test]
fn rewriting_the_routers_certificate_files_serves_the_new_certificate_without_a_restart() {
    let (cluster, certs, rotated, old, new) = rotation_of("router");
    rt().block_on(async {
        assert_eq!(served_certificate(&cluster).await, old);
        install(rotated.path(), &certs, "router");
        // The router looks at the files in the handshake itself: the next connection after
        // the rotation gets the new pair, with no wait.
        assert!(
            served_certificate(&cluster).await == new,
            "the router still serves the old certificate\n{}",
            cluster.log("router")
        );
        // Still serving requests after the rotation, over the new certificate.
        assert_completes(&cluster).await;
    });
    assert!(cluster.wait_log(
        "router",
        "HTTPS certificate reloaded",
        Duration::from_secs(10)
    ));
}

/// The leaf certificate (DER) the worker at `address` (`https://HOST:PORT`) presents to a new
/// connection, handshaking as the router of `certs`.
async fn worker_certificate(address: &str, certs: &Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in tandem_tls::read_certs(&certs.join("ca.crt")).expect("the CA") {
        roots.add(c).expect("a CA certificate");
    }
    let chain = tandem_tls::read_certs(&certs.join("router.crt")).expect("the router's chain");
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(certs.join("router.key"))
        .expect("the router's key");
    let config = rustls::ClientConfig::builder_with_provider(tandem_tls::provider())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .expect("a client identity");
    let tcp = tokio::net::TcpStream::connect(address.trim_start_matches("https://"))
        .await
        .expect("the worker's port");
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("a name");
    let tls = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)).connect(name, tcp),
    )
    .await
    .expect("a handshake in time")
    .expect("a handshake");
    tls.get_ref()
        .1
        .peer_certificates()
        .expect("the worker's chain")[0]
        .to_vec()
}

#[test]
fn rewriting_a_workers_certificate_files_serves_the_new_certificate_without_a_restart() {
    let (cluster, certs, rotated, old, new) = rotation_of("prefill");
    let prefill = cluster.prefill_addr.clone();
    rt().block_on(async {
        assert_eq!(worker_certificate(&prefill, &certs).await, old);
        install(rotated.path(), &certs, "prefill");
        assert!(
            worker_certificate(&prefill, &certs).await == new,
            "the worker still serves the old certificate\n{}",
            cluster.log("prefill")
        );
        // The rotated worker still takes the router's calls (and its per-call role checks
        // still read the router's certificate off the new kind of stream).
        let ok = stats(&prefill, Some(tls(&certs, Some((&certs, "router"))))).await;
        assert_eq!(
            ok.expect("stats over the rotated certificate").role,
            "prefill"
        );
        assert_completes(&cluster).await;
    });
    assert!(cluster.wait_log(
        "prefill",
        "gRPC certificate reloaded",
        Duration::from_secs(10)
    ));
}

#[test]
fn with_etcd_over_tls_workers_holding_a_client_certificate_register_and_one_without_is_refused() {
    // etcd serves TLS with --client-cert-auth; the workers and the router present their own
    // certificates to it. The cluster being ready means the router found both workers there.
    let mut cluster = Cluster::start(ClusterOptions {
        tls: true,
        discovery: true,
        ..ClusterOptions::default()
    });
    let certs = cluster.tls_dir.clone().expect("certificates");
    let etcd = cluster.etcd.as_ref().expect("an etcd").url();
    assert!(etcd.starts_with("https://"), "{etcd}");
    let url = cluster.url.clone();
    rt().block_on(async {
        let https = cluster.https_client();
        let workers: serde_json::Value = https
            .get(format!("{url}/admin/workers"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let mut ids: Vec<&str> = workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["id"].as_str().unwrap())
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, ["decode", "prefill"], "{workers}");
        let (status, body) = post(
            &https,
            &format!("{url}/v1/completions"),
            json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    });
    // A worker that trusts etcd's CA but has no client certificate is refused at its first
    // registration and exits with the reason.
    let file = |name: &str| certs.join(name).display().to_string();
    let model = tandem_testkit::smollm2_dir().display().to_string();
    let child = std::process::Command::new(tandem_e2e::tandem_bin())
        .args(["worker", "--role", "decode", "--model", &model])
        .args(["--listen", "127.0.0.1:0", "--kv-blocks", "64"])
        .args(["--discovery", &etcd, "--discovery-prefix", "/e2e"])
        .args(["--etcd-ca", &file("ca.crt")])
        .args([
            "--tls-cert",
            &file("decode2.crt"),
            "--tls-key",
            &file("decode2.key"),
        ])
        .args(["--tls-client-ca", &file("ca.crt")])
        .env("UCX_NET_DEVICES", "lo")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    cluster.adopt("uncertified", child);
    let status = cluster.wait_exit("uncertified", Duration::from_secs(120));
    let log = cluster.log("uncertified");
    assert!(
        !status.success(),
        "registered without a client certificate\n{log}"
    );
    assert!(log.contains("registering in etcd"), "{log}");
    assert!(!log.contains("worker ready"), "{log}");
}
