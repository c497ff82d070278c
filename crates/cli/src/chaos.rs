//! `tandem chaos`: the fault-injecting proxy, synthetic traces, and replays with a verdict.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use tandem_chaos::{Outcome, Scenario, Verdict};

/// `tandem chaos …`.
#[derive(clap::Subcommand, Debug)]
pub enum ChaosCommand {
    /// A TCP/HTTP-2 proxy that injects the scenario's faults between a router and a worker.
    Proxy {
        /// Where to listen (`host:port`; port 0 picks one, logged in the ready line).
        #[arg(long)]
        listen: String,
        /// The worker to forward to (`host:port` or `http://host:port`).
        #[arg(long)]
        upstream: String,
        /// Scenario YAML; no faults when absent.
        #[arg(long)]
        scenario: Option<PathBuf>,
        /// Admin HTTP port (`GET /stats`, `PUT /scenario`), e.g. `127.0.0.1:0`.
        #[arg(long)]
        admin: Option<String>,
    },
    /// Replays a trace against a router: a fault-free baseline first, then the run under
    /// the scenario; prints a verdict and exits 1 when anything is lost, hung, different or
    /// leaked.
    Replay {
        /// JSON-lines trace (`tandem chaos trace` writes one).
        #[arg(long)]
        trace: PathBuf,
        /// The router, `http://host:port`.
        #[arg(long)]
        target: String,
        /// Scenario put on every proxy (`--proxy-admin`) for the run; the baseline runs with
        /// their faults off.
        #[arg(long)]
        scenario: Option<PathBuf>,
        /// A proxy's admin URL (`http://host:port`); repeat for several proxies.
        #[arg(long)]
        proxy_admin: Vec<String>,
        /// A process the scenario's `kill` section may kill, and the file holding its pid
        /// (read before every kill, so a restarted process is found): `NAME=PIDFILE`;
        /// repeat for several (`tandem run` writes `prefill`, `decode` and `router` pid files
        /// and restarts killed workers).
        #[arg(long, value_parser = tandem_chaos::kill::parse_process)]
        process: Vec<(String, PathBuf)>,
        /// Requests in flight at once.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// A request unanswered after this long counts as hung.
        #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// A saved baseline (`--save-baseline` of an earlier replay) instead of a fresh one.
        #[arg(long)]
        baseline: Option<PathBuf>,
        /// Where to save this run's baseline.
        #[arg(long)]
        save_baseline: Option<PathBuf>,
        /// Write the verdict as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Writes a synthetic trace of greedy requests.
    Trace {
        /// Output JSON-lines file.
        #[arg(long)]
        out: PathBuf,
        /// Number of requests.
        #[arg(long, default_value_t = 200)]
        requests: usize,
        /// Seed of the mix.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The `model` field of each request (the router's served name).
        #[arg(long, default_value = "smollm2-135m-instruct")]
        model: String,
    },
}

/// Runs a chaos command.
pub fn run(command: ChaosCommand, runtime: tokio::runtime::Runtime) -> Result<()> {
    match command {
        ChaosCommand::Proxy {
            listen,
            upstream,
            scenario,
            admin,
        } => runtime.block_on(proxy(listen, upstream, scenario, admin)),
        ChaosCommand::Trace {
            out,
            requests,
            seed,
            model,
        } => {
            if requests == 0 {
                bail!("--requests must be at least 1");
            }
            let lines: Vec<String> = tandem_chaos::synth_trace(requests, seed, &model)
                .iter()
                .map(serde_json::to_string)
                .collect::<Result<_, _>>()?;
            std::fs::write(&out, lines.join("\n") + "\n")
                .with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {requests} requests to {}", out.display());
            Ok(())
        }
        ChaosCommand::Replay {
            trace,
            target,
            scenario,
            proxy_admin,
            process,
            concurrency,
            timeout,
            baseline,
            save_baseline,
            json,
        } => {
            let entries = tandem_chaos::read_trace(&trace).map_err(anyhow::Error::msg)?;
            // Checked here, so a bad file fails before anything is sent.
            let (scenario_text, kill) = match &scenario {
                Some(p) => {
                    let s = Scenario::load(p)?;
                    (Some(std::fs::read_to_string(p)?), s.kill)
                }
                None => (None, Default::default()),
            };
            let processes: BTreeMap<String, PathBuf> = process.into_iter().collect();
            tandem_chaos::kill::check_targets(&kill, &processes).map_err(anyhow::Error::msg)?;
            let verdict = runtime.block_on(replay(
                &entries,
                &target,
                scenario_text,
                &proxy_admin,
                (kill, processes),
                concurrency,
                timeout,
                baseline,
                save_baseline,
            ))?;
            println!(
                "chaos replay: {} requests at concurrency {concurrency} against {target}",
                entries.len()
            );
            print!("{}", verdict.table());
            if let Some(p) = json {
                std::fs::write(&p, serde_json::to_string_pretty(&verdict)?)
                    .with_context(|| format!("writing {}", p.display()))?;
            }
            if verdict.passed() {
                Ok(())
            } else {
                bail!("the replay lost, hung, changed or leaked something (verdict above)")
            }
        }
    }
}

async fn proxy(
    listen: String,
    upstream: String,
    scenario: Option<PathBuf>,
    admin: Option<String>,
) -> Result<()> {
    let scenario = match &scenario {
        Some(p) => Scenario::load(p)?,
        None => Scenario::default(),
    };
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let proxy = tandem_chaos::Proxy::new(&upstream, &scenario);
    let admin_addr = match admin {
        Some(a) => {
            let l = tokio::net::TcpListener::bind(&a)
                .await
                .with_context(|| format!("binding {a}"))?;
            let addr = l.local_addr()?;
            tokio::spawn(tandem_chaos::serve_admin(proxy.clone(), l));
            Some(addr)
        }
        None => None,
    };
    tracing::info!(listen = %listener.local_addr()?, upstream = %upstream,
        admin = ?admin_addr, "chaos proxy ready");
    proxy
        .clone()
        .serve(listener, crate::shutdown_signal())
        .await?;
    tracing::info!(stats = %proxy.stats_json(), "chaos proxy stopped");
    Ok(())
}

async fn put_scenario(client: &reqwest::Client, admin: &str, text: &str) -> Result<()> {
    let url = format!("{}/scenario", admin.trim_end_matches('/'));
    let resp = client
        .put(&url)
        .body(text.to_string())
        .send()
        .await
        .with_context(|| format!("PUT {url}"))?;
    if !resp.status().is_success() {
        bail!("PUT {url}: {}", resp.text().await.unwrap_or_default());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn replay(
    entries: &[tandem_chaos::TraceEntry],
    target: &str,
    scenario: Option<String>,
    proxies: &[String],
    (kill, processes): (
        tandem_chaos::scenario::KillFaults,
        BTreeMap<String, PathBuf>,
    ),
    concurrency: usize,
    timeout: Duration,
    baseline: Option<PathBuf>,
    save_baseline: Option<PathBuf>,
) -> Result<Verdict> {
    let client = reqwest::Client::new();
    let base: Vec<Outcome> = match baseline {
        Some(p) => serde_json::from_str(
            &std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("{} is not a saved baseline", p.display()))?,
        None => {
            for a in proxies {
                put_scenario(&client, a, "").await?;
            }
            eprintln!(
                "baseline: {} requests with the proxies' faults off…",
                entries.len()
            );
            tandem_chaos::replay(target, entries, concurrency, timeout).await
        }
    };
    if base.len() != entries.len() {
        bail!(
            "the baseline has {} outcomes, the trace {} requests",
            base.len(),
            entries.len()
        );
    }
    if let Some(p) = save_baseline {
        std::fs::write(&p, serde_json::to_string(&base)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(text) = &scenario {
        for a in proxies {
            put_scenario(&client, a, text).await?;
        }
    }
    eprintln!("run: {} requests under the scenario…", entries.len());
    let kills = std::sync::Arc::new(tandem_chaos::kill::KillCounts::default());
    let killer = tokio::spawn(tandem_chaos::kill::run(kill, processes, kills.clone()));
    let run = tandem_chaos::replay(target, entries, concurrency, timeout).await;
    killer.abort();
    let mut injected = BTreeMap::new();
    for (name, count) in [("kill", &kills.killed), ("kill.skipped", &kills.skipped)] {
        let n = count.load(std::sync::atomic::Ordering::Relaxed);
        if n > 0 {
            injected.insert(name.to_string(), n);
        }
    }
    for a in proxies {
        let url = format!("{}/stats", a.trim_end_matches('/'));
        let stats: serde_json::Value = client
            .get(&url)
            .send()
            .await
            .with_context(|| format!("GET {url}"))?
            .json()
            .await?;
        if let Some(m) = stats["injected"].as_object() {
            for (k, v) in m {
                *injected.entry(k.clone()).or_insert(0) += v.as_u64().unwrap_or(0);
            }
        }
    }
    let leaks = tandem_chaos::leaks(target).await;
    let mut verdict = Verdict::judge(&run, &base, leaks);
    verdict.injected = injected;
    Ok(verdict)
}
