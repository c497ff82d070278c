//! `tandem`: one binary, one subcommand per process role. Everything here is argument
//! parsing and wiring; the work lives in the library crates.

mod bench;
mod certs;
mod chaos;
mod cluster;
mod device;
mod eval;
mod models;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;
use tandem_core::SamplingParams;
use tandem_engine::{DType, Engine, EngineConfig, SeqKind};

#[derive(Parser, Debug)]
#[command(
    name = "tandem",
    version,
    about = "Prefill/decode disaggregated LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the OpenAI-compatible HTTP router.
    Router(RouterArgs),
    /// Run a prefill or decode worker.
    Worker(Box<WorkerArgs>),
    /// Run a local cluster: router + 1 prefill + 1 decode worker as separate processes.
    Run(cluster::RunArgs),
    /// Manage models.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Greedy generation in one process; prints token ids and text as JSON.
    Generate(GenerateArgs),
    /// Evaluate a model (logits of a full forward).
    Eval {
        #[command(subcommand)]
        command: EvalCommand,
    },
    /// Operate on running workers.
    Admin {
        #[command(subcommand)]
        command: AdminCommand,
    },
    /// Fault injection: a proxy, synthetic traces, replays with a verdict.
    Chaos {
        #[command(subcommand)]
        command: chaos::ChaosCommand,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
    /// Certificates for mutual TLS.
    Tls {
        #[command(subcommand)]
        command: TlsCommand,
    },
}

#[derive(Subcommand, Debug)]
enum TlsCommand {
    /// Write a throwaway CA and a certificate per component (each naming its role), for a
    /// local or test cluster.
    Generate(certs::GenerateArgs),
}

/// How an operator's tool reaches a worker whose gRPC port takes mutual TLS only.
#[derive(clap::Args, Debug)]
struct AdminTlsArgs {
    /// PEM CA certificates the worker's certificate must chain to (with an `https://`
    /// worker).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    /// This tool's certificate, naming the `admin` role.
    #[arg(long, requires = "tls_ca")]
    tls_cert: Option<PathBuf>,
    /// Its private key.
    #[arg(long, requires = "tls_ca")]
    tls_key: Option<PathBuf>,
}

impl AdminTlsArgs {
    /// A client of the worker at `worker`, over mutual TLS when configured.
    async fn connect(
        &self,
        worker: &str,
    ) -> Result<tandem_proto::v1::worker_client::WorkerClient<tonic::transport::Channel>> {
        let mut endpoint = tonic::transport::Endpoint::from_shared(worker.to_string())
            .with_context(|| format!("bad worker address {worker}"))?;
        if let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            let read =
                |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
            endpoint = endpoint.tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(read(ca)?))
                    .identity(tonic::transport::Identity::from_pem(
                        read(cert)?,
                        read(key)?,
                    )),
            )?;
        }
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("connecting to {worker}"))?;
        Ok(tandem_proto::v1::worker_client::WorkerClient::new(channel))
    }
}

#[derive(Subcommand, Debug)]
enum AdminCommand {
    /// Reload a worker's weights from a checkpoint directory (on the worker's machine), in
    /// place.
    RefreshWeights {
        /// The worker's gRPC address, `http://host:port`.
        #[arg(long)]
        worker: String,
        /// Checkpoint directory to load.
        #[arg(long)]
        model_dir: PathBuf,
        #[command(flatten)]
        tls: AdminTlsArgs,
    },
    /// Drain a worker: it stops taking new requests, deregisters from discovery, finishes
    /// what it has in flight and exits 0 (what still runs at the deadline is migrated by
    /// the router).
    Drain {
        /// The worker's gRPC address, `http://host:port`.
        #[arg(long)]
        worker: String,
        /// How long the worker waits for its requests; its own `--drain-deadline` when absent.
        #[arg(long, value_parser = humantime::parse_duration)]
        deadline: Option<Duration>,
        #[command(flatten)]
        tls: AdminTlsArgs,
    },
}

#[derive(Subcommand, Debug)]
enum EvalCommand {
    /// Raw f32 logits of every position of a full forward.
    Logits {
        /// Model directory or known name.
        #[arg(long, default_value = models::DEFAULT_MODEL)]
        model: String,
        /// Input as comma-separated token ids.
        #[arg(long, value_delimiter = ',', required = true)]
        token_ids: Vec<u32>,
        /// Print JSON (`{"logits": [[...], ...]}`); the only output format.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        layout: eval::LayoutArgs,
        /// Weights and K/V dtype.
        #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
        dtype: DtypeArg,
        /// Device the model runs on: cpu, cuda, cuda:N or a list of GPUs (cuda:0,cuda:1).
        #[arg(long, default_value = "cpu", value_parser = device::parse)]
        device: device::Device,
    },
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Download and import a known model into the local cache.
    Pull {
        /// Model name (e.g. smollm2-135m-instruct).
        name: String,
    },
    /// List the models `pull` knows.
    List,
    /// Write a random checkpoint (tests, benchmarks).
    Synth {
        /// Model family.
        #[arg(long, value_parser = ["kda-hybrid", "llama"], default_value = "kda-hybrid")]
        arch: String,
        /// Size preset (kda-hybrid: tiny, medium, 1b, 48b = Kimi-Linear-48B-A3B's dimensions;
        /// llama: tiny, smollm2, 1b, 8b).
        #[arg(long, default_value = "tiny")]
        preset: String,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Block-FP8 projections (kda-hybrid: KDA projections stay BF16 and are listed as
        /// ignored; llama: every attention and MLP projection).
        #[arg(long)]
        fp8: bool,
        /// Seed of the values.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// KDA-hybrid only: this many decoder layers instead of the preset's (same per-layer
        /// dimensions; the 48b preset's 27 layers do not load on one GPU's host in f32).
        #[arg(long)]
        layers: Option<usize>,
    },
}

/// `tandem worker --kv-landing`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LandingArg {
    /// Shared memory on one host, else one-sided UCX writes, else a message.
    Auto,
    /// One-sided UCX writes (even on one host), else a message.
    Put,
    /// Always a message.
    Off,
}

/// The dtype weights and K/V are kept in (activations and accumulation are f32).
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DtypeArg {
    /// 32-bit floats.
    #[default]
    F32,
    /// bfloat16 weights and K/V.
    Bf16,
}

impl DtypeArg {
    /// The engine's dtype.
    pub fn dtype(self) -> DType {
        match self {
            DtypeArg::F32 => DType::F32,
            DtypeArg::Bf16 => DType::BF16,
        }
    }
}

/// KDA-hybrid models still compute in f32 on the host.
#[derive(ValueEnum, Clone, Copy, Debug)]
enum RoleArg {
    Prefill,
    Decode,
    /// Prefill and decode in this process, no transfer (aggregated serving).
    Both,
}

#[derive(clap::Args, Debug)]
struct EngineArgs {
    /// Model directory (Hugging Face layout) or a known model name.
    #[arg(long, default_value = models::DEFAULT_MODEL, env = "TANDEM_MODEL")]
    model: String,
    /// KV blocks in the paged pool (16 tokens each; MLA latents for KDA-hybrid models).
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// Request-state slots per attention-DP group (KDA-hybrid models).
    #[arg(long, default_value_t = 64)]
    state_slots: usize,
    /// Tokens per step (decodes + prefill chunks, shared among the prompts in progress).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Keep nothing for later prompts: no prefix caching (K/V blocks, or KDA-hybrid states).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Host memory for KDA-hybrid states kept for prefix caching, in MiB.
    #[arg(long, default_value_t = 512)]
    prefix_state_mib: usize,
    /// Parallel layout (KDA-hybrid models; ranks are threads of this process).
    #[command(flatten)]
    layout: eval::LayoutArgs,
    /// PEFT LoRA adapter directory merged at start-up (KDA-hybrid models); layers whose
    /// projections it targets run unfused.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Weights and K/V dtype.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Device the model runs on: cpu, cuda, cuda:N or a list of GPUs (cuda:0,cuda:1).
    #[arg(long, default_value = "cpu", value_parser = device::parse, env = "TANDEM_DEVICE")]
    device: device::Device,
    /// What computes tokens: the model, or `synthetic` (no compute: every step takes
    /// `--synthetic-step` and tokens are a function of position; for control-plane load
    /// tests; the model directory gives only the vocabulary, context and EOS ids).
    #[arg(long, value_enum, default_value_t = EngineKind::Model)]
    engine: EngineKind,
    /// Time one synthetic step takes.
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    synthetic_step: Duration,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum EngineKind {
    /// The checkpoint's model.
    Model,
    /// No compute (see `--engine`).
    Synthetic,
}

impl EngineArgs {
    fn start(&self) -> Result<Engine> {
        let dir = models::resolve(&self.model)?;
        self.start_model(&dir)
    }

    /// The engine's settings for the checkpoint in `dir` (its tokenizer, where it has one,
    /// constrains structured outputs).
    fn engine_config(&self, dir: &std::path::Path) -> EngineConfig {
        let tokenizer = dir.join("tokenizer.json");
        EngineConfig {
            num_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            prefix_cache: !self.no_prefix_cache,
            prefix_snapshot_bytes: self.prefix_state_mib << 20,
            tokenizer: tokenizer.exists().then_some(tokenizer),
            ..EngineConfig::default()
        }
    }

    /// The checkpoint in `dir` (any family) loaded by the engine's loader and served.
    fn start_model(&self, dir: &std::path::Path) -> Result<Engine> {
        struct Serve<'a>(&'a EngineArgs, &'a std::path::Path);
        impl eval::WithLoaded for Serve<'_> {
            type Out = Engine;
            fn run<B: tandem_engine::backend::HybridOps>(
                self,
                model: tandem_engine::Loaded<B>,
            ) -> Result<Engine> {
                let Serve(args, dir) = self;
                let config = EngineConfig {
                    state_slots: args.state_slots,
                    ..args.engine_config(dir)
                };
                Ok(model.serve(config)?)
            }
        }
        eval::with_model(
            dir,
            self.layout,
            self.lora.as_deref(),
            self.dtype.dtype(),
            self.device,
            Serve(self, dir),
        )
    }

    /// The engine for a worker: Llama or KDA hybrid, from the checkpoint's `model_type`.
    fn start_worker_engine(&self) -> Result<tandem_worker::WorkerEngine> {
        let dir = models::resolve(&self.model)?;
        if self.engine == EngineKind::Synthetic {
            let card = eval::card(&dir)?;
            let vocab_size = card.vocab_size()?;
            let spec = tandem_engine::models::synthetic::SyntheticSpec {
                vocab_size,
                max_context: card.context_length(4096, None),
                eos_ids: card.eos_token_ids,
                step_time: self.synthetic_step,
            };
            tracing::info!(step = ?self.synthetic_step, vocab_size, "synthetic engine: no model compute");
            return Ok(tandem_engine::models::synthetic::SyntheticServed::start(
                spec,
                // Synthetic tokens ignore logits: no grammar could hold them.
                EngineConfig {
                    tokenizer: None,
                    ..self.engine_config(&dir)
                },
            )?
            .into());
        }
        Ok(self.start_model(&dir)?.into())
    }
}

#[derive(clap::Args, Debug)]
struct WorkerArgs {
    /// Which role this worker serves.
    #[arg(long, value_enum)]
    role: RoleArg,
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:50061")]
    listen: String,
    /// Decode role: KV transport listen address (port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:0")]
    transfer_listen: String,
    /// Decode role: how long a reservation waits for its KV.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    kv_lease: Duration,
    /// Prefill role: the longest one KV push may take.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    transfer_timeout: Duration,
    /// Decode role: MiB of shared memory (/dev/shm) that prefill workers on this host write
    /// handoffs into directly (only the completion record then crosses the transport); 0
    /// sends every handoff over the transport.
    #[arg(long, env = "TANDEM_KV_LANDING_MIB", default_value_t = 256)]
    kv_landing_mib: usize,
    /// Prefill role: how a handoff reaches the decode worker's landing slot: `auto` (shared
    /// memory on one host, else one-sided UCX writes into the registered arena, else a
    /// message), `put` (one-sided writes even on one host), `off` (always a message).
    #[arg(long, value_enum, default_value_t = LandingArg::Auto)]
    kv_landing: LandingArg,
    /// On SIGTERM or `tandem admin drain`: how long to wait for in-flight requests before
    /// exiting anyway.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    drain_deadline: Duration,
    /// Register in etcd for routers to find: `etcd://host:port[,host:port…]`.
    #[arg(long, env = "TANDEM_DISCOVERY")]
    discovery: Option<String>,
    /// Key prefix of this deployment in etcd.
    #[arg(long, default_value = "/tandem")]
    discovery_prefix: String,
    /// Reach etcd over TLS, checking its certificate against these CA certificates (PEM);
    /// the --discovery endpoints are then https://.
    #[arg(long, env = "TANDEM_ETCD_CA", requires = "discovery")]
    etcd_ca: Option<PathBuf>,
    /// The client certificate (PEM) presented to etcd, for an etcd started with
    /// --client-cert-auth; needs --etcd-key and --etcd-ca.
    #[arg(long, env = "TANDEM_ETCD_CERT", requires_all = ["etcd_key", "etcd_ca"])]
    etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM).
    #[arg(long, env = "TANDEM_ETCD_KEY", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// Lease TTL of the etcd registration: a worker killed without deregistering disappears
    /// after this long.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    lease_ttl: Duration,
    /// The gRPC URL routers should use (`http://host:port`, `https://` with TLS); from the
    /// bound address when absent (which must then not be a wildcard address).
    #[arg(long)]
    advertise: Option<String>,
    /// This worker's id in discovery; `ROLE-HOST-PORT` when absent.
    #[arg(long)]
    worker_id: Option<String>,
    /// Prefill role, testing only: inject the `transfer` faults of this chaos scenario into
    /// KV pushes (`tandem chaos`).
    #[arg(long)]
    chaos_scenario: Option<PathBuf>,
    /// Serve gRPC over mutual TLS with this certificate (PEM, naming the worker's role as a
    /// URI SAN `spiffe://…/prefill`); needs --tls-key and --tls-client-ca.
    #[arg(long, env = "TANDEM_TLS_CERT", requires_all = ["tls_key", "tls_client_ca"])]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "TANDEM_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// CA certificates (PEM) callers' certificates must chain to; callers must also name a
    /// role the call allows (the router for serving calls, admin for drain and reloads).
    #[arg(long, env = "TANDEM_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(clap::Args, Debug)]
struct RouterArgs {
    /// Router YAML config (static worker lists).
    #[arg(long)]
    config: PathBuf,
    /// Model directory or known name; overrides the config's model.dir.
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<String>,
    /// Listen address; overrides the config's.
    #[arg(long)]
    listen: Option<String>,
    /// Chat template instead of the model's own: a Jinja file, or `chatml-tools` (built in:
    /// ChatML with tool calling, for models whose template has none); overrides the config's.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Append every generation request (path and body, one JSON line each) to this file:
    /// a trace for `tandem chaos replay`.
    #[arg(long)]
    record_trace: Option<PathBuf>,
    /// Only check the config file (every problem is reported) and exit.
    #[arg(long)]
    check: bool,
}

#[derive(clap::Args, Debug)]
struct GenerateArgs {
    /// Model directory or known name.
    #[arg(long, default_value = models::DEFAULT_MODEL)]
    model: String,
    /// Prompt text (tokenized without special tokens added).
    #[arg(long, conflicts_with = "token_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Print JSON (`{"token_ids": [...], "text": "..."}`).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    layout: eval::LayoutArgs,
    /// PEFT LoRA adapter directory (KDA-hybrid models).
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Weights and K/V dtype.
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    dtype: DtypeArg,
    /// Device the model runs on: cpu, cuda, cuda:N or a list of GPUs (cuda:0,cuda:1).
    #[arg(long, default_value = "cpu", value_parser = device::parse)]
    device: device::Device,
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TANDEM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour codes only on a terminal: logs piped to files or collectors stay plain text.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    init_tracing();
    match cli.command {
        Command::Model {
            command: ModelCommand::Pull { name },
        } => {
            let dir = models::pull(&name)?;
            println!("{}", dir.display());
            Ok(())
        }
        Command::Model {
            command:
                ModelCommand::Synth {
                    arch,
                    preset,
                    out,
                    fp8,
                    seed,
                    layers,
                },
        } => {
            let written = if arch == "llama" {
                if layers.is_some() {
                    bail!("--layers is for KDA-hybrid presets");
                }
                tandem_model::synth::synth_llama_with(&preset, &out, seed, fp8)
            } else {
                tandem_model::synth::synth_kda_hybrid_layers(&preset, &out, fp8, seed, layers)
            };
            written.with_context(|| format!("writing {}", out.display()))?;
            println!("{}", out.display());
            Ok(())
        }
        Command::Model {
            command: ModelCommand::List,
        } => {
            for name in tandem_model::pull::known_models() {
                println!("{name}");
            }
            Ok(())
        }
        Command::Generate(args) => generate(args),
        Command::Admin {
            command:
                AdminCommand::RefreshWeights {
                    worker,
                    model_dir,
                    tls,
                },
        } => runtime()?.block_on(async move {
            let mut client = tls.connect(&worker).await?;
            let dir = std::fs::canonicalize(&model_dir).unwrap_or(model_dir);
            let reply = client
                .refresh_weights(tandem_proto::v1::RefreshWeightsRequest {
                    model_dir: dir.display().to_string(),
                })
                .await
                .map_err(|s| anyhow::anyhow!("{worker}: {}", s.message()))?;
            println!("{}", reply.into_inner().message);
            Ok(())
        }),
        Command::Admin {
            command:
                AdminCommand::Drain {
                    worker,
                    deadline,
                    tls,
                },
        } => runtime()?.block_on(async move {
            let mut client = tls.connect(&worker).await?;
            let deadline_ms = deadline.map_or(0, |d| {
                u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
            });
            let reply = client
                .drain(tandem_proto::v1::DrainRequest { deadline_ms })
                .await
                .map_err(|s| anyhow::anyhow!("{worker}: {}", s.message()))?;
            println!("{}", reply.into_inner().message);
            Ok(())
        }),
        Command::Eval {
            command:
                EvalCommand::Logits {
                    model,
                    token_ids,
                    json: _,
                    layout,
                    dtype,
                    device,
                },
        } => {
            let dir = models::resolve(&model)?;
            let logits = eval::logits(&dir, &token_ids, layout, dtype, device)?;
            println!("{}", serde_json::json!({ "logits": logits }));
            Ok(())
        }
        Command::Worker(args) => runtime()?.block_on(worker(*args)),
        Command::Router(args) => runtime()?.block_on(router(args)),
        Command::Run(args) => cluster::run(args),
        Command::Bench { command } => bench::run(command),
        Command::Chaos { command } => chaos::run(command, runtime()?),
        Command::Tls {
            command: TlsCommand::Generate(args),
        } => certs::run(args),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

async fn worker(args: WorkerArgs) -> Result<()> {
    let engine = args.engine.start_worker_engine()?;
    let dir = models::resolve(&args.engine.model)?;
    let model_id = tandem_model::model_identity(&dir, args.engine.dtype.dtype().name())
        .with_context(|| format!("reading {}", dir.display()))?;
    let role = match args.role {
        RoleArg::Prefill => tandem_worker::Role::Prefill,
        RoleArg::Decode => tandem_worker::Role::Decode,
        RoleArg::Both => tandem_worker::Role::Both,
    };
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let bound = listener.local_addr()?;
    let tls = match (args.tls_cert, args.tls_key, args.tls_client_ca) {
        (Some(cert), Some(key), Some(client_ca)) => Some(tandem_worker::GrpcTls {
            cert,
            key,
            client_ca,
        }),
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let registration = match &args.discovery {
        Some(url) => {
            let mut config = tandem_discovery::EtcdConfig::from_url(
                url,
                &args.discovery_prefix,
                args.lease_ttl,
            )?;
            if let Some(ca) = &args.etcd_ca {
                let identity = args.etcd_cert.clone().zip(args.etcd_key.clone());
                config = config.with_tls(tandem_discovery::EtcdTls {
                    ca: ca.clone(),
                    identity: identity
                        .map(|(cert, key)| tandem_discovery::ClientIdentity { cert, key }),
                });
            }
            let address = match &args.advertise {
                Some(a) => a.clone(),
                None if bound.ip().is_unspecified() => anyhow::bail!(
                    "--listen {bound} is a wildcard address: pass --advertise http://HOST:PORT for discovery"
                ),
                None => format!("{scheme}://{bound}"),
            };
            let host = address
                .split("://")
                .nth(1)
                .unwrap_or(&address)
                .replace([':', '.', '/'], "-");
            let record = tandem_discovery::WorkerRecord {
                id: args
                    .worker_id
                    .clone()
                    .unwrap_or_else(|| format!("{}-{host}", role.as_str())),
                role: match role {
                    tandem_worker::Role::Prefill => tandem_discovery::WorkerRole::Prefill,
                    tandem_worker::Role::Decode => tandem_discovery::WorkerRole::Decode,
                    tandem_worker::Role::Both => tandem_discovery::WorkerRole::Both,
                },
                address,
                layout: engine.layout_info().0,
                model_id: format!("{model_id:016x}"),
                capacity: engine.kv_blocks().0 as u64,
                state: tandem_discovery::WorkerState::Active,
            };
            Some(
                tandem_discovery::Registration::start(config, record)
                    .await
                    .with_context(|| format!("registering in etcd at {url}"))?,
            )
        }
        None => None,
    };
    tracing::info!(role = role.as_str(), listen = %bound, mutual_tls = tls.is_some(), "worker ready");
    let opts = tandem_worker::WorkerOptions {
        role,
        transfer_bind: args.transfer_listen,
        kv_lease: args.kv_lease,
        transfer_timeout: args.transfer_timeout,
        kv_landing_bytes: args.kv_landing_mib << 20,
        kv_landing: match args.kv_landing {
            LandingArg::Auto => tandem_worker::LandingMode::Auto,
            LandingArg::Put => tandem_worker::LandingMode::Put,
            LandingArg::Off => tandem_worker::LandingMode::Off,
        },
        model_id,
        drain_deadline: args.drain_deadline,
        transfer_chaos: match &args.chaos_scenario {
            Some(p) => {
                let s = tandem_chaos::Scenario::load(p)?;
                tracing::warn!(scenario = %p.display(), "chaos: transfer faults are injected into this worker's KV pushes");
                Some(std::sync::Arc::new(tandem_chaos::TransferChaos::new(&s)))
            }
            None => None,
        },
        tls,
    };
    tandem_worker::serve_registered(engine, opts, listener, shutdown_signal(), registration)
        .await?;
    tracing::info!("worker stopped");
    Ok(())
}

async fn router(args: RouterArgs) -> Result<()> {
    if args.check {
        let c = tandem_router::config::RouterConfig::load(&args.config)
            .with_context(|| format!("{}", args.config.display()))?;
        let discovery = c.discovery.as_ref().map_or("none".to_string(), |d| {
            format!("etcd {}", d.etcd.endpoints.join(","))
        });
        println!(
            "{}: valid ({} prefill, {} decode, {} aggregated static workers; discovery {discovery}; policy {:?})",
            args.config.display(),
            c.prefill.len(),
            c.decode.len(),
            c.aggregated.len(),
            c.policy
        );
        return Ok(());
    }
    let model_dir = match &args.model {
        Some(m) => Some(models::resolve(m)?),
        None => None,
    };
    tandem_router::run_from_config(
        &args.config,
        tandem_router::Overrides {
            model_dir,
            chat_template: args.chat_template,
            listen: args.listen,
            record_trace: args.record_trace,
        },
        shutdown_signal(),
    )
    .await
    .map_err(|e| anyhow::anyhow!(e))
}

fn generate(args: GenerateArgs) -> Result<()> {
    let dir = models::resolve(&args.model)?;
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = if tokenizer_path.exists() {
        Some(
            tokenizers::Tokenizer::from_file(&tokenizer_path)
                .map_err(|e| anyhow::anyhow!("loading tokenizer: {e}"))?,
        )
    } else {
        None
    };
    let prompt = match (&args.prompt, &args.token_ids, &tokenizer) {
        (Some(text), _, Some(tok)) => tok
            .encode(text.as_str(), false)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
            .get_ids()
            .to_vec(),
        (Some(_), _, None) => bail!("{} has no tokenizer.json: pass --token-ids", dir.display()),
        (None, Some(ids), _) => ids.clone(),
        (None, None, _) => bail!("give --prompt or --token-ids"),
    };
    let decode = |ids: &[u32]| -> Result<String> {
        match &tokenizer {
            Some(t) => t
                .decode(ids, false)
                .map_err(|e| anyhow::anyhow!("decoding: {e}")),
            None => Ok(String::new()),
        }
    };
    if eval::family(&dir)? == eval::Family::KdaHybrid {
        let ids = eval::generate_kda(
            &dir,
            &prompt,
            args.max_tokens,
            args.layout,
            args.lora.as_deref(),
            args.dtype.dtype(),
            args.device,
        )?;
        let text = decode(&ids)?;
        if args.json {
            println!("{}", serde_json::json!({ "token_ids": ids, "text": text }));
        } else {
            println!("{text}");
        }
        return Ok(());
    }
    let engine = EngineArgs {
        model: dir.display().to_string(),
        kv_blocks: 1024,
        state_slots: 64,
        max_batch_tokens: 512,
        no_prefix_cache: false,
        prefix_state_mib: 512,
        layout: args.layout,
        lora: None,
        dtype: args.dtype,
        device: args.device,
        engine: EngineKind::Model,
        synthetic_step: Duration::ZERO,
    }
    .start()?;
    let ids = tandem_engine::blocking_tokens(engine.submit(
        prompt,
        SamplingParams::greedy(args.max_tokens),
        SeqKind::Generate,
    )?);
    let text = decode(&ids)?;
    if args.json {
        println!("{}", serde_json::json!({ "token_ids": ids, "text": text }));
    } else {
        println!("{text}");
    }
    Ok(())
}
