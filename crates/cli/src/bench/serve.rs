//! `tandem bench serve`: a load generator for any OpenAI-compatible server (tandem's router,
//! vLLM, SGLang), streaming completions or chat completions, reporting what
//! `vllm bench serve` reports under the same JSON keys, so figures from either client line
//! up in one table.
//!
//! With `--arms A=URL,B=URL --order ABBA` it is the ordered A/B/B/A method done in one
//! command: every block of every arm sends the same seeded requests at the same seeded
//! arrival times; an arm's blocks are pooled (output tokens summed over durations summed,
//! latency percentiles over every request of every block); the report gives the ratios to
//! the baseline (the first arm named), the drift between the baseline's first and last
//! positions, whether each arm's outputs are byte-identical to the baseline's first block,
//! and a verdict against a gate stated before the run (`--gate throughput:+1%,ttft_p95:-5%`).
//!
//! The statistics, dataset readers, arrival times and gate are plain functions with their
//! own tests in the modules below; only this file's client touches the network.

/// `--arms`, `--order`, `--gate`: parsing, the verdict, the output identity check.
mod compare;
/// The random, JSONL and ShareGPT datasets, and seeded arrival times.
mod dataset;
/// Percentiles, goodput and the result under `vllm bench serve`'s keys.
mod stats;

use anyhow::{bail, Context, Result};
use compare::{first_difference, judge, parse_arm, parse_gate_term, parse_order, Arm, GateTerm};
use dataset::{arrival_times, BenchRequest, DatasetName, Prompt};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use stats::{parse_slo, Metrics, RequestOutput, Slo};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `tandem bench serve`'s arguments (named after `vllm bench serve`'s where one exists).
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// The server's base URL (without `--arms`).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// `/v1/completions` or `/v1/chat/completions`.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Served model name; the first one `/v1/models` lists when left out.
    #[arg(long)]
    pub model: Option<String>,
    /// Dataset.
    #[arg(long, value_enum, default_value_t = DatasetName::Random)]
    pub dataset_name: DatasetName,
    /// The JSONL or ShareGPT file.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Measured requests per block.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Random dataset: prompt tokens.
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Random dataset: output tokens.
    #[arg(long, default_value_t = 128)]
    pub random_output_len: u32,
    /// Random dataset: lengths are drawn uniformly from `len * (1 ± ratio)`.
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Random dataset without `--tokenizer`: token ids are drawn below this bound (every
    /// common vocabulary is at least this large).
    #[arg(long, default_value_t = 32000)]
    pub random_vocab: u32,
    /// Output tokens of every JSONL/ShareGPT request (overrides the file's own lengths).
    #[arg(long)]
    pub output_len: Option<u32>,
    /// A `tokenizer.json` (or a model directory holding one): the random dataset's vocabulary
    /// and text for chat, the ShareGPT replies' lengths.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Requests per second (`inf`: all at once).
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    /// Shape of the gamma-distributed gaps between arrivals (1: Poisson; below 1 burstier).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests sent (and awaited) before each arm's measured blocks, not counted.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// Generate the full output length whatever tokens come.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature (0: greedy, which the identity check across arms relies on).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seeds the dataset, the arrival times and each request's sampling seed (`seed + i`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Percentiles reported for TTFT, TPOT, ITL and E2EL.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "50,95,99",
        alias = "metric-percentiles"
    )]
    pub percentiles: Vec<f64>,
    /// Service-level objectives in milliseconds for goodput: `ttft:500 tpot:50 e2el:2000`.
    #[arg(long, num_args = 1.., value_parser = parse_slo)]
    pub goodput: Vec<Slo>,
    /// Write the result as JSON here too.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Include per-request figures and texts in the JSON (`input_lens`, `ttfts`, ...).
    #[arg(long)]
    pub save_detailed: bool,
    /// Arms to compare: `NAME=URL,NAME=URL`; the first is the baseline.
    #[arg(long, value_delimiter = ',', value_parser = parse_arm)]
    pub arms: Vec<Arm>,
    /// The order the arms run in: arm names, one letter each (`ABBA`) or comma-separated.
    #[arg(long, requires = "arms")]
    pub order: Option<String>,
    /// Blocks run at each position of the order.
    #[arg(long, default_value_t = 1)]
    pub blocks: usize,
    /// Pass/fail terms, each the least change against every baseline position, counted in
    /// the metric's good direction: `throughput:+1%` needs 1% more output throughput,
    /// `ttft_p95:-5%` allows TTFT p95 at most 5% worse.
    #[arg(long, value_delimiter = ',', value_parser = parse_gate_term, requires = "arms")]
    pub gate: Vec<GateTerm>,
}

/// What every block sends to.
struct Target {
    url: String,
    model: String,
    chat: bool,
}

/// The first model the server lists.
async fn first_model(client: &reqwest::Client, base: &str) -> Result<String> {
    let v: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .with_context(|| format!("GET {base}/v1/models"))?
        .error_for_status()?
        .json()
        .await?;
    v["data"][0]["id"]
        .as_str()
        .map(String::from)
        .with_context(|| format!("{base}/v1/models lists no model"))
}

/// The request body.
fn body(t: &Target, r: &BenchRequest, args: &ServeArgs, seed: u64) -> Value {
    let mut b = json!({
        "model": t.model,
        "max_tokens": r.output_len,
        "temperature": args.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
        "seed": seed,
    });
    if args.ignore_eos {
        b["ignore_eos"] = json!(true);
    }
    let prompt = match &r.prompt {
        Prompt::Text(s) => json!(s),
        Prompt::Tokens(ids) => json!(ids),
    };
    if t.chat {
        b["messages"] = json!([{"role": "user", "content": prompt}]);
    } else {
        b["prompt"] = prompt;
    }
    b
}

/// Sends one request and reads its stream: TTFT is taken at the first chunk carrying text
/// (an empty first chunk does not count), ITLs are the gaps between text-carrying chunks.
async fn send(
    client: &reqwest::Client,
    t: &Target,
    body: Value,
    r: &BenchRequest,
) -> RequestOutput {
    let mut out = RequestOutput {
        prompt_len: r.prompt_len.unwrap_or(0),
        ..Default::default()
    };
    let start = Instant::now();
    let resp = match client.post(&t.url).json(&body).send().await {
        Ok(resp) => resp,
        Err(e) => {
            out.error = e.to_string();
            return out;
        }
    };
    if !resp.status().is_success() {
        let status = resp.status();
        out.error = format!("{status}: {}", resp.text().await.unwrap_or_default());
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let (mut last, mut chunks, mut usage) = (None::<Instant>, 0usize, None::<usize>);
    let mut done = false;
    while let Some(piece) = stream.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                out.error = e.to_string();
                return out;
            }
        };
        let now = Instant::now();
        buf.extend_from_slice(&piece);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                out.error = format!("not JSON: {data}");
                return out;
            };
            if !v["error"].is_null() {
                out.error = v["error"].to_string();
                return out;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(n as usize);
                if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
                    out.prompt_len = p as usize;
                }
            }
            let c = &v["choices"][0];
            let text = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str());
            if let Some(text) = text.filter(|s| !s.is_empty()) {
                match last {
                    None => out.ttft = (now - start).as_secs_f64(),
                    Some(l) => out.itl.push((now - l).as_secs_f64()),
                }
                last = Some(now);
                chunks += 1;
                out.text.push_str(text);
            }
        }
    }
    out.latency = start.elapsed().as_secs_f64();
    if !done {
        out.error = "the stream ended without [DONE]".into();
        return out;
    }
    out.output_len = usage.unwrap_or(chunks);
    out.success = true;
    out
}

/// Sends `requests` at `arrivals` (seconds from now), at most `max_concurrency` at once;
/// the outputs in request order and the block's duration.
async fn run_block(
    client: &reqwest::Client,
    target: &Arc<Target>,
    args: &Arc<ServeArgs>,
    requests: &Arc<Vec<BenchRequest>>,
    arrivals: &[f64],
    bar: &indicatif::ProgressBar,
) -> Result<(Vec<RequestOutput>, f64)> {
    let sem = args
        .max_concurrency
        .map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
    let t0 = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (i, at) in arrivals.iter().enumerate() {
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(*at)).await;
        let (client, target, args, requests, sem, bar) = (
            client.clone(),
            target.clone(),
            args.clone(),
            requests.clone(),
            sem.clone(),
            bar.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let _permit = match &sem {
                Some(s) => Some(s.clone().acquire_owned().await.expect("never closed")),
                None => None,
            };
            let r = &requests[i];
            let b = body(&target, r, &args, args.seed.wrapping_add(i as u64));
            let out = send(&client, &target, b, r).await;
            bar.inc(1);
            out
        }));
    }
    let mut outs = Vec::with_capacity(tasks.len());
    for t in tasks {
        outs.push(t.await.context("a request task")?);
    }
    Ok((outs, t0.elapsed().as_secs_f64()))
}

/// Sends the first `n` requests (cycling) and awaits them; their figures are dropped.
async fn warm_up(
    client: &reqwest::Client,
    target: &Arc<Target>,
    args: &Arc<ServeArgs>,
    requests: &Arc<Vec<BenchRequest>>,
) -> Result<()> {
    if args.num_warmups == 0 {
        return Ok(());
    }
    let warm: Vec<BenchRequest> = (0..args.num_warmups)
        .map(|i| requests[i % requests.len()].clone())
        .collect();
    let (outs, _) = run_block(
        client,
        target,
        args,
        &Arc::new(warm),
        &vec![0.0; args.num_warmups],
        &indicatif::ProgressBar::hidden(),
    )
    .await?;
    if let Some(o) = outs.iter().find(|o| !o.success) {
        bail!("a warm-up request failed: {}", o.error);
    }
    Ok(())
}

fn progress(total: usize) -> indicatif::ProgressBar {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:40} {pos}/{len} requests [{elapsed_precise}<{eta_precise}]",
    ) {
        bar.set_style(style);
    }
    bar
}

/// The detailed per-request lists `--save-detailed` adds.
fn detailed(m: &mut Map<String, Value>, outs: &[RequestOutput]) {
    m.insert(
        "input_lens".into(),
        json!(outs.iter().map(|o| o.prompt_len).collect::<Vec<_>>()),
    );
    m.insert(
        "output_lens".into(),
        json!(outs.iter().map(|o| o.output_len).collect::<Vec<_>>()),
    );
    m.insert(
        "ttfts".into(),
        json!(outs.iter().map(|o| o.ttft).collect::<Vec<_>>()),
    );
    m.insert(
        "itls".into(),
        json!(outs.iter().map(|o| &o.itl).collect::<Vec<_>>()),
    );
    m.insert(
        "generated_texts".into(),
        json!(outs.iter().map(|o| &o.text).collect::<Vec<_>>()),
    );
    m.insert(
        "errors".into(),
        json!(outs.iter().map(|o| &o.error).collect::<Vec<_>>()),
    );
}

/// `tandem bench serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run_async(args))
}

async fn run_async(args: ServeArgs) -> Result<()> {
    if args.num_prompts == 0 || args.blocks == 0 {
        bail!("--num-prompts and --blocks are at least 1");
    }
    if args.request_rate.is_nan()
        || args.request_rate <= 0.0
        || args.burstiness.is_nan()
        || args.burstiness <= 0.0
    {
        bail!("--request-rate and --burstiness are above 0");
    }
    let chat = args.endpoint.contains("chat");
    let requests = Arc::new(dataset::dataset(&args, chat)?);
    let arrivals = arrival_times(
        requests.len(),
        args.request_rate,
        args.burstiness,
        args.seed,
    );
    let client = reqwest::Client::builder()
        .build()
        .context("an HTTP client")?;
    let (arms, order) = if args.arms.is_empty() {
        let arm = Arm {
            name: "A".into(),
            url: args.base_url.trim_end_matches('/').to_string(),
        };
        (vec![arm], vec![0])
    } else {
        let order = match &args.order {
            Some(o) => parse_order(o, &args.arms)?,
            None => (0..args.arms.len()).collect(),
        };
        (args.arms.clone(), order)
    };
    let mut targets = Vec::new();
    for arm in &arms {
        let model = match &args.model {
            Some(m) => m.clone(),
            None => first_model(&client, &arm.url).await?,
        };
        targets.push(Arc::new(Target {
            url: format!("{}{}", arm.url, args.endpoint),
            model,
            chat,
        }));
    }
    let args = Arc::new(args);
    let bar = progress(order.len() * args.blocks * requests.len());
    // blocks[position] = that position's blocks (outputs, duration).
    let mut positions: Vec<Vec<(Vec<RequestOutput>, f64)>> = Vec::new();
    for &arm in &order {
        warm_up(&client, &targets[arm], &args, &requests).await?;
        let mut blocks = Vec::new();
        for _ in 0..args.blocks {
            blocks
                .push(run_block(&client, &targets[arm], &args, &requests, &arrivals, &bar).await?);
        }
        positions.push(blocks);
    }
    bar.finish_and_clear();
    let ps = &args.percentiles;
    let pooled = |blocks: Vec<&(Vec<RequestOutput>, f64)>| {
        let outs: Vec<RequestOutput> = blocks.iter().flat_map(|b| b.0.iter().cloned()).collect();
        Metrics::of(&outs, blocks.iter().map(|b| b.1).sum(), ps, &args.goodput)
    };
    let header = |m: &mut Map<String, Value>, arm: &Arm| {
        m.insert(
            "backend".into(),
            json!(if chat { "openai-chat" } else { "openai" }),
        );
        m.insert("base_url".into(), json!(arm.url));
        m.insert("endpoint".into(), json!(args.endpoint));
        m.insert("num_prompts".into(), json!(requests.len()));
        m.insert(
            "request_rate".into(),
            json!(if args.request_rate.is_finite() {
                json!(args.request_rate)
            } else {
                json!("inf")
            }),
        );
        m.insert("burstiness".into(), json!(args.burstiness));
        m.insert("max_concurrency".into(), json!(args.max_concurrency));
        m.insert("seed".into(), json!(args.seed));
    };

    if args.arms.is_empty() {
        let (outs, duration) = &positions[0][0];
        let m = Metrics::of(outs, *duration, ps, &args.goodput);
        print!("{}", m.table("Serving Benchmark Result"));
        if let Some(path) = &args.json {
            let mut j = m.to_json();
            header(&mut j, &arms[0]);
            j.insert("model_id".into(), json!(targets[0].model));
            if args.save_detailed {
                detailed(&mut j, outs);
            }
            std::fs::write(path, serde_json::to_string_pretty(&Value::Object(j))?)?;
        }
        if let Some(o) = outs.iter().find(|o| !o.success) {
            eprintln!("{} requests failed; the first: {}", m.failed, o.error);
        }
        return Ok(());
    }

    // Per arm: its pooled figures, and each of its positions' figures.
    let label = |pos: usize| {
        let arm = order[pos];
        let nth = order[..=pos].iter().filter(|&&a| a == arm).count() - 1;
        format!("{}{nth}", arms[arm].name)
    };
    let mut report = Map::new();
    let mut arm_metrics = Vec::new();
    for (a, arm) in arms.iter().enumerate() {
        let mine: Vec<usize> = (0..order.len()).filter(|&p| order[p] == a).collect();
        let m = pooled(mine.iter().flat_map(|&p| positions[p].iter()).collect());
        print!(
            "{}",
            m.table(&format!(
                "Arm {} (pooled, {} blocks)",
                arm.name,
                mine.len() * args.blocks
            ))
        );
        let mut j = m.to_json();
        header(&mut j, arm);
        j.insert("model_id".into(), json!(targets[a].model));
        let mut blocks = Vec::new();
        let mut line = Vec::new();
        for &p in &mine {
            for (outs, d) in &positions[p] {
                let block = Metrics::of(outs, *d, ps, &args.goodput);
                line.push(format!("{} {:.3}", label(p), block.output_throughput));
                let mut b = block.to_json();
                b.insert("position".into(), json!(label(p)));
                if args.save_detailed {
                    detailed(&mut b, outs);
                }
                blocks.push(Value::Object(b));
            }
        }
        println!("Blocks of {}, output tok/s: {}", arm.name, line.join(" / "));
        j.insert("blocks".into(), json!(blocks));
        report.insert(arm.name.clone(), Value::Object(j));
        arm_metrics.push((mine, m));
    }

    // Ratios to the baseline, figure by figure.
    let base = &arm_metrics[0].1;
    let fig = |m: &Metrics, f: &str| m.figure(f).unwrap_or(0.0);
    let figures = [
        "throughput",
        "ttft_p50",
        "ttft_p95",
        "ttft_p99",
        "tpot_p50",
        "tpot_p95",
        "e2el_p95",
        "e2el_p99",
    ];
    println!(
        "{:=^50}",
        " Ratios to arm ".to_string() + &arms[0].name + " "
    );
    println!(
        "{:<12}{}",
        "arm",
        figures
            .iter()
            .map(|f| format!("{f:>11}"))
            .collect::<String>()
    );
    let mut ratios = Map::new();
    for (a, (_, m)) in arm_metrics.iter().enumerate() {
        let row: Vec<f64> = figures
            .iter()
            .map(|f| {
                let b = fig(base, f);
                if b == 0.0 {
                    0.0
                } else {
                    fig(m, f) / b
                }
            })
            .collect();
        println!(
            "{:<12}{}",
            arms[a].name,
            row.iter().map(|r| format!("{r:>11.4}")).collect::<String>()
        );
        ratios.insert(
            arms[a].name.clone(),
            Value::Object(
                figures
                    .iter()
                    .zip(&row)
                    .map(|(f, r)| (f.to_string(), json!(r)))
                    .collect(),
            ),
        );
    }

    // Drift between the baseline's first and last positions.
    let base_positions = &arm_metrics[0].0;
    let position_metrics = |p: usize| pooled(positions[p].iter().collect());
    let baselines: Vec<(String, Metrics)> = base_positions
        .iter()
        .map(|&p| (label(p), position_metrics(p)))
        .collect();
    let drift = (baselines.len() > 1).then(|| {
        let (first, last) = (&baselines[0].1, &baselines[baselines.len() - 1].1);
        let d = |f: &str| {
            let b = fig(first, f);
            if b == 0.0 {
                0.0
            } else {
                (fig(last, f) / b - 1.0) * 100.0
            }
        };
        (d("throughput"), d("ttft_p95"))
    });
    match drift {
        Some((t, l)) => println!(
            "Drift {} -> {}: throughput {t:+.3}%, TTFT p95 {l:+.3}%",
            baselines[0].0,
            baselines[baselines.len() - 1].0
        ),
        None => println!("Drift: n/a (the baseline runs at one position)"),
    }

    // Byte identity against the baseline's first block.
    let reference = &positions[base_positions[0]][0].0;
    let mut identity = Map::new();
    for (a, (mine, _)) in arm_metrics.iter().enumerate() {
        let blocks: Vec<Vec<RequestOutput>> = mine
            .iter()
            .flat_map(|&p| positions[p].iter().map(|b| b.0.clone()))
            .collect();
        let diff = first_difference(reference, &blocks);
        match diff {
            None => println!(
                "Outputs of {}: bitwise identical to {} ({} blocks)",
                arms[a].name,
                baselines[0].0,
                blocks.len()
            ),
            Some(i) => println!(
                "Outputs of {}: differ from {} at request {i}",
                arms[a].name, baselines[0].0
            ),
        }
        identity.insert(
            arms[a].name.clone(),
            json!({"identical": diff.is_none(), "first_difference": diff}),
        );
    }

    // The verdict.
    let candidates: Vec<(String, &Metrics)> = arm_metrics
        .iter()
        .enumerate()
        .skip(1)
        .map(|(a, (_, m))| (arms[a].name.clone(), m))
        .collect();
    let base_refs: Vec<(String, &Metrics)> =
        baselines.iter().map(|(n, m)| (n.clone(), m)).collect();
    let checks = judge(&args.gate, &candidates, &base_refs);
    let passed = checks.iter().all(|c| c.passed);
    for c in &checks {
        println!(
            "Gate {} vs {}: {} {:+.3}% better (needs {:+}%): {}",
            c.candidate,
            c.baseline,
            c.figure,
            c.improvement,
            c.needed,
            if c.passed { "pass" } else { "FAIL" }
        );
    }
    if !args.gate.is_empty() {
        println!(
            "Verdict: {}",
            if passed { "gate met" } else { "gate not met" }
        );
    }

    if let Some(path) = &args.json {
        let order_names: Vec<String> = (0..order.len()).map(label).collect();
        let j = json!({
            "order": order_names,
            "blocks_per_position": args.blocks,
            "baseline": arms[0].name,
            "arms": report,
            "ratios": ratios,
            "drift": drift.map(|(t, l)| json!({"throughput_pct": t, "ttft_p95_pct": l})),
            "bitwise_identical": identity,
            "gate": checks.iter().map(|c| json!({
                "candidate": c.candidate, "baseline": c.baseline, "figure": c.figure,
                "improvement_pct": c.improvement, "needed_pct": c.needed, "passed": c.passed,
            })).collect::<Vec<_>>(),
            "verdict": (!args.gate.is_empty()).then_some(passed),
        });
        std::fs::write(path, serde_json::to_string_pretty(&j)?)?;
    }
    if !passed {
        bail!("the gate was not met");
    }
    Ok(())
}
